"""Experiment: the fault matrix — every fault a real run meets, in every mode.

Owns one measurement: a small job (the tiny quickstart: SFT, reward model, PPO with a
critic; the tiny arith GRPO job for the critic-free path) run under one fault at a time,
then resumed, in each mode: `sequential`, `per_stage`, `pipe` (on one process, staleness
0, so that a resume must reproduce the uninterrupted run exactly) and `pipe` across two
processes (`python -m pipe_rlhf_jax.launch`). The faults
(`tests/distributed/fault_worker.py` injects them at a chosen moment of a chosen step):

* SIGINT, SIGTERM and SIGKILL at a moment of generate / infer / train (the update
  dispatched, not yet fetched) / a checkpoint write in progress, at a step drawn at
  random (seeded);
* an exception in one stage; a stage that never returns (a native call: a hung reward
  server), with `plan.progress_timeout_s=20`;
* across two processes: a SIGTERM to the launcher, one process SIGKILLed, one stuck,
  one raising.

For each case it records: the exit status against the documented one (130 / 143 after a
final checkpoint, -9 for SIGKILL, 1 for an exception, 124 for a stalled step), seconds
from the fault to the end of the job, PPO steps lost (finished before the fault but not
in a checkpoint), and whether the resumed run's PPO metrics equal the uninterrupted
run's (every float within rtol 1e-5; the queue counters excluded, they count items since
a run's start).

Usage:
  python -m experiments.fault_matrix            # the whole matrix (about 40 min on 2 cores)
  python -m experiments.fault_matrix --quick    # one case of each fault kind
  python -m experiments.fault_matrix --only sequential:sigterm@train
  python -m experiments.fault_matrix --only arith:pipe:sigkill@save

Writes experiments/out/fault_matrix/cases.jsonl and docs/results/fault_matrix.md (with
`--only`, the page goes to experiments/out/fault_matrix/ instead).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from experiments import results  # noqa: E402

WORKER = os.path.join(_ROOT, "tests", "distributed", "fault_worker.py")
STEPS = 6
EVERY = 2  # checkpoint interval: a SIGKILL loses what came after the last one
PROGRESS_TIMEOUT_S = 20
EXPECTED = {"sigint": 130, "sigterm": 143, "sigkill": -9, "raise": 1, "hang": 124}
NOT_COMPARED = ("time", "tokens_per_s", "seconds", "bytes_per_second", "blocked_s",
                "wait_s", "queue/", "transfer/")
MODES = ("sequential", "per_stage", "pipe", "pipe_2proc")


def job_args(job: str, mode: str, workdir: str, warm: str | None) -> list[str]:
  """The main job's flags for one run of `job` in `mode`."""
  if job == "quickstart":
    args = [f"--config={os.path.join(_ROOT, 'configs', 'quickstart.py')}:tiny"]
  else:
    args = [f"--config={os.path.join(_ROOT, 'configs', 'grpo_arith.py')}:tiny",
            "--config.sft.steps=0"]
  process_mode = "pipe" if mode == "pipe_2proc" else mode
  args += [f"--config.plan.mode={process_mode}", f"--config.ppo.steps={STEPS}",
           f"--config.checkpoint.every={EVERY}", "--config.log.tensorboard=False",
           "--config.plan.shutdown_timeout_s=10", f"--workdir={workdir}"]
  if mode in ("pipe", "pipe_2proc"):
    # On policy: pipe mode then computes what sequential computes, whatever the timing
    # of its stages, so a resumed run can be compared with an uninterrupted one.
    args.append("--config.plan.max_staleness=0")
  if mode == "per_stage":
    # A 2-layer model with one kv head has no pipeline x tensor layout over all 8 devices.
    args += ["--config.stages.generate.mesh.pipeline=1", "--config.stages.generate.mesh.data=-1"]
  if warm:
    args.append(f"--config.warm_start.checkpoint={warm}")
  return args


def run_job(job: str, mode: str, workdir: str, warm: str | None, fault: str = "",
            resume: bool = False, extra: tuple[str, ...] = (), timeout_s: float = 600,
            signal_launcher_at: str | None = None) -> dict:
  """Runs one job (one process, or two through the launcher); returns what it did."""
  env = {**os.environ, "PYTHONPATH": _ROOT, "PIPE_RLHF_JAX_FAULT": fault}
  # The caller's XLA flags pass on, all but its device count: each job sets its own.
  flags = [f for f in env.pop("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  args = [*job_args(job, mode, workdir, warm), *extra] + (["--resume"] if resume else [])
  if mode == "pipe_2proc":
    logs = os.path.join(workdir + ".logs" + ("_resume" if resume else ""))
    cmd = [sys.executable, "-m", "pipe_rlhf_jax.launch", "--num_processes=2",
           "--cpu_devices=4", f"--log_dir={logs}", f"--timeout_s={timeout_s}",
           "--stop_grace_s=120", "--grace_s=60",
           f"--command={sys.executable} -u {WORKER}", "--", *args]
  else:
    env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=8"])
    cmd = [sys.executable, "-u", WORKER, *args]
  start = time.time()
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, cwd=_ROOT, start_new_session=True)
  injected = None
  output = []
  deadline = time.monotonic() + timeout_s
  try:
    for line in proc.stdout:
      output.append(line)
      m = re.search(r"\[fault_worker\] injecting .* t=([0-9.]+)", line)
      if m:
        injected = float(m.group(1))
      if (signal_launcher_at and injected is None
          and re.search(rf"ppo step {signal_launcher_at}/", line)):
        injected = time.time()
        proc.send_signal(signal.SIGTERM)
      if time.monotonic() > deadline:
        break
    proc.wait(timeout=max(deadline - time.monotonic(), 1))
  except subprocess.TimeoutExpired:
    pass
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  end = time.time()
  text = "".join(output)
  if mode == "pipe_2proc":
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
      with open(os.path.join(logs, name), encoding="utf-8", errors="replace") as f:
        part = f.read()
      text += part
      m = re.search(r"\[fault_worker\] injecting .* t=([0-9.]+)", part)
      if m and injected is None:
        injected = float(m.group(1))
  return {"status": proc.returncode, "seconds": end - start,
          "stop_s": (end - injected) if injected else None, "output": text}


def ppo_rows(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  return [r for r in rows if r["phase"] == "ppo"]


def checkpoints(workdir: str) -> list[int]:
  root = os.path.join(workdir, "checkpoints")
  return sorted(int(s) for s in os.listdir(root) if s.isdigit()) if os.path.isdir(root) else []


def same_math(a: list[dict], b: list[dict]) -> tuple[bool, float]:
  """Whether two runs' PPO rows agree (rtol 1e-5), and the largest relative difference."""
  if [r["step"] for r in a] != [r["step"] for r in b]:
    return False, math.inf
  worst = 0.0
  for x, y in zip(a, b):
    for k, v in x.items():
      if any(t in k for t in NOT_COMPARED) or not isinstance(v, float):
        continue
      w = y.get(k)
      if w is None:
        return False, math.inf
      worst = max(worst, abs(v - w) / max(abs(w), 1e-6))
  return worst <= 1e-5, worst


def cases(quick: bool, rng: random.Random) -> list[tuple[str, str, str, str]]:
  """(job, mode, fault, label) of the matrix."""
  out = []
  moments = ("generate", "infer", "train", "save")
  for mode in ("sequential", "per_stage", "pipe"):
    for kind in ("sigint", "sigterm", "sigkill"):
      for moment in moments:
        if quick and (moment != "train" or mode != "sequential"):
          continue
        # Steps 1..STEPS-2 (not the first, which compiles; not the last); a save call
        # n is the checkpoint of step EVERY*(n+1)-1.
        call = rng.randint(0, STEPS // EVERY - 2) if moment == "save" else rng.randint(
            1, STEPS - 2)
        out.append(("quickstart", mode, f"{kind}@{moment}:{call}", f"{kind} in {moment}"))
    for kind in ("raise", "hang"):
      if quick and mode != "sequential":
        continue
      out.append(("quickstart", mode, f"{kind}@infer:{rng.randint(1, STEPS - 2)}",
                  {"raise": "exception in infer", "hang": "stuck infer"}[kind]))
  for mode in ("sequential", "pipe"):  # the critic-free path
    if quick and mode != "sequential":
      continue
    out.append(("arith", mode, f"sigterm@train:{rng.randint(1, STEPS - 2)}",
                "sigterm in train"))
    if not quick:
      out.append(("arith", mode, "sigkill@save:1", "sigkill in save"))
  # Across two processes (generation and inference on process 1, training on 0).
  two = [("launcher", "SIGTERM to the launcher"),
         (f"sigkill@generate:{rng.randint(1, STEPS - 2)}:1", "process 1 killed"),
         (f"hang@generate:{rng.randint(1, STEPS - 2)}:1", "process 1 stuck"),
         (f"raise@infer:{rng.randint(1, STEPS - 2)}:1", "process 1 raises")]
  for fault, label in (two[:1] if quick else two):
    out.append(("quickstart", "pipe_2proc", fault, label))
  return out


def run_case(job, mode, fault, label, base, warm, references) -> dict:
  name = re.sub(r"[^A-Za-z0-9_]+", "_", f"{job}_{mode}_{fault}")
  workdir = os.path.join(base, name)
  shutil.rmtree(workdir, ignore_errors=True)
  extra = (f"--config.plan.progress_timeout_s={PROGRESS_TIMEOUT_S}",)
  launcher = fault == "launcher"
  kind = "sigterm" if launcher else fault.split("@")[0]
  first = run_job(job, mode, workdir, warm.get(job), "" if launcher else fault,
                  extra=extra, signal_launcher_at="3" if launcher else None)
  finished = [r["step"] for r in ppo_rows(workdir)]
  saved = checkpoints(workdir)
  last_finished = max(finished) if finished else -1
  last_saved = max(saved) if saved else -1
  expected = EXPECTED[kind]
  status = first["status"]
  clean = status == expected or (mode == "pipe_2proc" and status == expected)
  if kind in ("sigint", "sigterm"):
    clean = clean and last_saved == last_finished
  second = run_job(job, mode, workdir, warm.get(job), resume=bool(saved), extra=extra)
  equal, worst = same_math(ppo_rows(workdir), references[(job, mode)])
  return {"job": job, "mode": mode, "fault": fault, "label": label, "status": status,
          "expected": expected, "clean": bool(clean), "stop_s": first["stop_s"],
          "finished": last_finished, "saved": last_saved,
          "lost": max(last_finished - last_saved, 0), "resume_status": second["status"],
          "equal": bool(equal and second["status"] == 0), "worst_rel_diff": worst,
          "tail": first["output"][-1500:] if not clean else ""}


def table(rows: list[dict]) -> str:
  lines = ["| job | mode | fault | exit (expected) | stopped cleanly | s to stop | "
           "steps lost | resumed = uninterrupted |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    stop = f"{r['stop_s']:.1f}" if r["stop_s"] is not None else "–"
    lines.append(f"| {r['job']} | {r['mode']} | {r['label']} (`{r['fault']}`) | "
                 f"{r['status']} ({r['expected']}) | {'yes' if r['clean'] else 'NO'} | "
                 f"{stop} | {r['lost']} | "
                 f"{'yes' if r['equal'] else 'NO'} (max rel. diff {r['worst_rel_diff']:.1e}) |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="one case of each fault kind")
  parser.add_argument("--only", default="",
                      help="[JOB:]MODE:FAULT, e.g. sequential:sigterm@train or "
                           "arith:pipe:sigkill@save")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out-dir", default=os.path.join(_ROOT, "experiments", "out",
                                                        "fault_matrix"))
  args = parser.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  limits = results.machine_limits()
  base = os.path.join(args.out_dir, "runs")
  os.makedirs(base, exist_ok=True)
  todo = cases(args.quick, random.Random(args.seed))
  if args.only:
    parts = args.only.split(":", 2)
    job, mode, fault = parts if parts[0] in ("quickstart", "arith") else ("", *parts[:2])
    todo = [c for c in todo if (not job or c[0] == job) and c[1] == mode
            and c[2].startswith(fault)][:1]
    if not todo:
      raise SystemExit(f"--only {args.only!r} matches no case of the matrix")
  # One warm start per job (the same in every mode: warm_start.mesh), one reference run
  # per job and mode.
  warm = {}
  for job in sorted({c[0] for c in todo}):
    if job == "quickstart":
      path = os.path.join(base, "warm_quickstart")
      if not os.path.isdir(os.path.join(path, "warmstart")):
        shutil.rmtree(path, ignore_errors=True)
        out = run_job(job, "sequential", path, None, extra=("--warm_start_only",))
        if out["status"] != 0:
          raise SystemExit(out["output"][-3000:])
      warm[job] = os.path.join(path, "warmstart")
  references = {}
  for job, mode in sorted({(c[0], c[1]) for c in todo}):
    path = os.path.join(base, f"reference_{job}_{mode}")
    shutil.rmtree(path, ignore_errors=True)
    out = run_job(job, mode, path, warm.get(job))
    if out["status"] != 0:
      raise SystemExit(f"the uninterrupted {job} run in {mode} failed:\n"
                       + out["output"][-3000:])
    references[(job, mode)] = ppo_rows(path)
    print(f"reference {job} {mode}: {out['seconds']:.0f} s", flush=True)
  rows = []
  with open(os.path.join(args.out_dir, "cases.jsonl"), "w", encoding="utf-8") as f:
    for case in todo:
      row = run_case(*case, base, warm, references)
      rows.append(row)
      f.write(json.dumps(row) + "\n")
      f.flush()
      print(table([row]).splitlines()[-1], flush=True)
  clean = sum(r["clean"] for r in rows)
  equal = sum(r["equal"] for r in rows)
  lost = sum(r["lost"] for r in rows if r["fault"].split("@")[0] in ("sigint", "sigterm"))
  body = (
      f"{len(rows)} cases: {clean} stopped as documented, {equal} resumed to the "
      f"uninterrupted run's metrics; finished steps lost to SIGINT / SIGTERM: {lost}.\n\n"
      "Each job runs PPO for "
      f"{STEPS} steps with a checkpoint every {EVERY}; a fault strikes at a moment of "
      "one step (`tests/distributed/fault_worker.py`: `kind@moment:call[:process]`), the job ends, "
      "and `--resume` finishes it. *Stopped cleanly*: the exit status is the documented "
      "one, and after SIGINT / SIGTERM the last finished step is the checkpointed one. "
      "*Steps lost*: finished steps that were not in a checkpoint (a SIGKILL loses the "
      "steps since the last periodic checkpoint, an exception or a stall those since "
      "the last one as well, unless the trainer could save). *Resumed = uninterrupted*: "
      "every float metric of every PPO step within rtol 1e-5 of the run that was never "
      "interrupted (pipe mode at staleness 0, which computes what sequential computes)."
      f"\n\n{table(rows)}\n")
  directory = args.out_dir if args.only else results.RESULTS_DIR
  path = results.write_page("fault_matrix", "Fault matrix", body, limits,
                            directory=directory)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
