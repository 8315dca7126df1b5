"""Benchmark of the three PPO modes: sequential, per_stage and pipe.

Owns one comparison: the quickstart config (configs/quickstart.py, optionally its "tiny"
variant) run end to end by `pipe_rlhf_jax.train.train` once per mode, same seed and
config otherwise, each in a fresh workdir under --out-dir. For every mode it reports,
over the steady-state PPO steps (the first --warmup-steps-excluded steps compile and are
left out):
  s_per_step      mean wall-clock seconds between consecutive PPO step completions
  samples_per_s   ppo.batch_size / s_per_step
  latency_s       mean time from a batch's generate start to its update's end
  generate_s ...  the stages' own compute times (`time/generate_s` etc.)
  busy fractions  per stage (generate, infer, train, sync) within the steady window
  overlap         seconds generate and train / generate and infer were busy together
  staleness       mean policy lag of the rollouts trained on (0 in the serial modes)
  weight sync     actor + critic bytes moved train -> generate / infer
plus the trace.json / gantt.png each run writes. Prints one table and writes
`modes.csv` and `modes.json` to --out-dir.

The pipe mode can be run at several staleness bounds (--max-staleness 0,1); 0 is the
on-policy schedule and shows what the bounded lag buys.

On virtual CPU devices every "device" shares the host's cores (and one XLA thread pool:
a small program on the generate devices waits behind a training program running on the
train devices), so the pipe mode shows overlap rather than a speed-up there, and a stage's
span, hence its busy fraction and overlaps, can include such waits; compare with the
stages' own compute times. On one GPU the device set cannot be split into
disjoint sub-meshes, so modes whose layouts do not fit the devices are skipped with the
reason printed.

The SFT and reward-model warm start is run once (by the first mode) and its checkpoint
copied into the later workdirs (the run restores it after checking its fingerprint), so
every mode starts PPO from the same policy and the benchmark time goes to PPO; pass
--no-share-warmstart to train it in every workdir. `checkpoint.every` is set to the PPO
step count, so the only PPO checkpoint is written after the last measured step.

Usage:
  python -m experiments.bench_modes
  python -m experiments.bench_modes --config-variant tiny --ppo-steps 8
  python -m experiments.bench_modes --modes pipe --max-staleness 0,1
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import shutil
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from pipe_rlhf_jax.host_devices import use_virtual_cpu_devices  # noqa: E402

use_virtual_cpu_devices()

from absl import logging as absl_logging  # noqa: E402
import jax  # noqa: E402

from configs import quickstart  # noqa: E402
from experiments import results  # noqa: E402
from pipe_rlhf_jax.config import MODES, STAGES, Plan  # noqa: E402
from pipe_rlhf_jax.system.system import build_layouts  # noqa: E402
from pipe_rlhf_jax.train import train  # noqa: E402

BUSY_STAGES = (*STAGES, "sync")


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config-variant", default="", choices=("", "tiny"),
                      help="configs/quickstart.py variant ('' = the full quickstart)")
  parser.add_argument("--ppo-steps", type=int, default=12)
  parser.add_argument("--warmup-steps-excluded", type=int, default=2,
                      help="first PPO steps (compilation) left out of the averages")
  parser.add_argument("--modes", default=",".join(MODES),
                      help=f"comma-separated subset of {','.join(MODES)}")
  parser.add_argument("--max-staleness", default="1",
                      help="pipe mode's plan.max_staleness; a comma-separated list "
                           "(e.g. 0,1) runs pipe once per value")
  parser.add_argument("--sft-steps", type=int, default=20)
  parser.add_argument("--rm-steps", type=int, default=20)
  parser.add_argument("--seed", type=int, default=0)
  # Under the repository's git-ignored experiments/out/, wherever the script is run from.
  parser.add_argument("--out-dir",
                      default=os.path.join(_ROOT, "experiments", "out", "bench_modes"))
  results.add_page_flag(parser, "modes")
  parser.add_argument("--no-share-warmstart", action="store_true",
                      help="train SFT + reward model in every workdir instead of once")
  args = parser.parse_args(argv)
  args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
  unknown = [m for m in args.modes if m not in MODES]
  if unknown or not args.modes:
    parser.error(f"--modes: unknown {unknown or '(empty)'}; choose from {','.join(MODES)}")
  try:
    args.max_staleness = [int(s) for s in args.max_staleness.split(",") if s.strip()]
  except ValueError:
    parser.error(f"--max-staleness {args.max_staleness!r}: give integers like 1 or 0,1")
  if not args.max_staleness or min(args.max_staleness) < 0:
    parser.error("--max-staleness: give one or more integers >= 0")
  if args.warmup_steps_excluded < 1:
    # Step k's duration is end(k) - end(k-1), so step 0 has none to measure.
    parser.error("--warmup-steps-excluded must be >= 1 (step 0 has no previous end)")
  if args.ppo_steps <= args.warmup_steps_excluded:
    parser.error(f"--ppo-steps ({args.ppo_steps}) must exceed --warmup-steps-excluded "
                 f"({args.warmup_steps_excluded}) to leave steps to measure")
  return args


# ---- one mode --------------------------------------------------------------------------
def make_config(args, mode: str, staleness: int):
  config = quickstart.get_config(args.config_variant)
  config.seed = args.seed
  config.plan.mode = mode
  config.plan.max_staleness = staleness
  config.ppo.steps = args.ppo_steps
  config.sft.steps = args.sft_steps
  config.reward_model.steps = args.rm_steps
  config.sft.warmup_steps = min(config.sft.warmup_steps, max(args.sft_steps - 1, 0))
  config.reward_model.warmup_steps = min(config.reward_model.warmup_steps,
                                         max(args.rm_steps - 1, 0))
  # One PPO checkpoint, after the last step, so no save lands inside the timed window.
  config.checkpoint.every = args.ppo_steps
  # One shared task dataset: built once, and part of the warm-start fingerprint.
  config.data.dir = os.path.abspath(os.path.join(args.out_dir, "data"))
  return config


def layout_summary(config) -> tuple[dict, str | None]:
  """{stage: {"devices", "mesh"}} for the config's mode, or the reason it cannot run."""
  try:
    layouts = build_layouts(Plan.from_config(config))
  except ValueError as e:
    return {}, str(e)
  return {s: {"devices": int(layouts[s].mesh.devices.size),
              "mesh": {k: int(v) for k, v in layouts[s].mesh.shape.items() if v > 1}}
          for s in STAGES}, None


def fresh_workdir(path: str) -> str:
  """Empties `path` if it is a previous workdir of this benchmark (refuses otherwise)."""
  if os.path.exists(path):
    if os.listdir(path) and not os.path.exists(os.path.join(path, "config.json")):
      raise FileExistsError(f"{path} exists and is not a previous bench_modes workdir; "
                            "choose another --out-dir.")
    shutil.rmtree(path)
  os.makedirs(path)
  return path


def measure(result: dict, config, warmup: int) -> dict:
  """Steady-state numbers of one finished run (see the module docstring)."""
  tracer = result.tracer
  records = sorted(result.ppo_metrics, key=lambda r: r["step"])
  # Throughput: the time between consecutive train-span ends. In the serial modes that is
  # one whole step (sync + generate + infer + train); in pipe mode the stages of different
  # batches overlap, so per-step `time/step_s` is a latency and summing stage times would
  # double count, while the spacing of completed updates is exactly the rate at which
  # the system turns out PPO steps. Same definition for every mode, so comparable.
  ends = sorted(s.end for s in tracer.spans("train"))
  if len(ends) != config.ppo.steps:
    raise RuntimeError(f"expected {config.ppo.steps} train spans, found {len(ends)}")
  intervals = [b - a for a, b in zip(ends[warmup - 1:], ends[warmup:])]
  s_per_step = sum(intervals) / len(intervals)
  window = (ends[warmup - 1], ends[-1])  # from the last warm-up update to the last update
  length = window[1] - window[0]
  busy = tracer.busy_fraction(window)
  steady = [r for r in records if r["step"] >= warmup]
  # Latency from the trace: start of a batch's generate span to the end of its train span.
  # (The pipe mode's `time/step_s` starts before the staleness gate, so it also counts
  # the wait for older updates, compile time included.)
  gen_start = {s.batch: s.start for s in tracer.spans("generate")}
  latencies = [s.end - gen_start[s.batch] for s in tracer.spans("train")
               if s.batch is not None and s.batch >= warmup and s.batch in gen_start]

  def mean(key: str) -> float:
    values = [r[key] for r in steady if key in r]
    return sum(values) / len(values) if values else float("nan")

  sync_keys = ("transfer/actor_sync/bytes", "transfer/critic_sync/bytes")
  sync_total = sum(r.get(k, 0.0) for r in records for k in sync_keys)
  workdir = result.workdir
  return {
      "s_per_step": s_per_step,
      "s_per_step_min": min(intervals),
      "s_per_step_max": max(intervals),
      "samples_per_s": config.ppo.batch_size / s_per_step,
      "latency_s": sum(latencies) / len(latencies) if latencies else float("nan"),
      "step_s_metric": mean("time/step_s"),
      "generate_s": mean("time/generate_s"),
      "infer_s": mean("time/infer_s"),
      "train_s": mean("time/train_s"),
      "window_s": length,
      **{f"busy/{s}": busy.get(s, 0.0) for s in BUSY_STAGES},
      "overlap/generate_train_s": tracer.overlap("generate", "train", window),
      "overlap/generate_infer_s": tracer.overlap("generate", "infer", window),
      "staleness_mean": mean("staleness/actor"),
      "sync_bytes_total": sync_total,
      "sync_bytes_per_step": sync_total / len(records),
      "reward_mean_last": records[-1].get("reward/mean", float("nan")),
      "wall_s": result.wall_s,
      "workdir": workdir,
      "trace": os.path.join(workdir, "trace.json"),
      "gantt": os.path.join(workdir, "gantt.png"),
  }


# ---- output ------------------------------------------------------------------------------
TABLE = (  # (header, key, format)
    ("mode", "label", "{}"),
    ("devices g/i/t", "devices", "{}"),
    ("s/step", "s_per_step", "{:.3f}"),
    ("samples/s", "samples_per_s", "{:.1f}"),
    ("latency s", "latency_s", "{:.3f}"),
    ("gen s", "generate_s", "{:.3f}"),
    ("trn s", "train_s", "{:.3f}"),
    ("busy gen", "busy/generate", "{:.2f}"),
    ("busy inf", "busy/infer", "{:.2f}"),
    ("busy trn", "busy/train", "{:.2f}"),
    ("busy sync", "busy/sync", "{:.2f}"),
    ("gen&trn s", "overlap/generate_train_s", "{:.2f}"),
    ("gen&inf s", "overlap/generate_infer_s", "{:.2f}"),
    ("stale", "staleness_mean", "{:.2f}"),
    ("sync MB", "sync_bytes_total", "{:.1f}"),
)


LEGEND = """\
s/step: mean time between consecutive PPO updates (steady state); latency: generate start
to update end of one batch; gen s / trn s: the stages' own compute times (time/*_s);
busy: fraction of the steady window a stage's span was open (includes waiting on devices
inside the span); gen&trn / gen&inf: seconds two stages' spans were open together;
stale: mean policy lag of trained rollouts; sync MB: actor + critic weight-sync bytes."""


def _cell(row: dict, key: str, fmt: str) -> str:
  value = row.get(key)
  if value is None:
    return "-"
  if key == "sync_bytes_total":
    value = value / 1e6
  return fmt.format(value)


def format_table(rows: list[dict]) -> str:
  cells = [[h for h, _, _ in TABLE]] + [[_cell(r, k, f) for _, k, f in TABLE] for r in rows]
  widths = [max(len(c[i]) for c in cells) for i in range(len(TABLE))]
  lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                     enumerate(zip(line, widths))) for line in cells]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


CSV_FIELDS = ("label", "mode", "max_staleness", "status", "devices", "s_per_step",
              "s_per_step_min", "s_per_step_max", "samples_per_s", "latency_s", "step_s_metric",
              "generate_s", "infer_s", "train_s", "window_s", *(f"busy/{s}" for s in
              BUSY_STAGES), "overlap/generate_train_s", "overlap/generate_infer_s",
              "staleness_mean", "sync_bytes_total", "sync_bytes_per_step",
              "reward_mean_last", "wall_s", "workdir", "trace", "gantt")


def write_outputs(out_dir: str, rows: list[dict], header: dict) -> tuple[str, str]:
  csv_path = os.path.join(out_dir, "modes.csv")
  with open(csv_path, "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
      writer.writerow({k: row.get(k, "") for k in CSV_FIELDS})
  json_path = os.path.join(out_dir, "modes.json")
  with open(json_path, "w", encoding="utf-8") as f:
    json.dump({**header, "runs": rows}, f, indent=2)
  return csv_path, json_path


def main(argv=None) -> int:
  args = parse_args(argv)
  command = results.command_line() if argv is None else shlex.join(argv)
  print(f"command: {command}", flush=True)
  absl_logging.set_verbosity(absl_logging.WARNING)
  devices = jax.devices()
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, {len(devices)} devices "
        f"({devices[0].device_kind}), {os.cpu_count()} host cores, load average "
        f"{os.getloadavg()[0]:.2f}", flush=True)
  os.makedirs(args.out_dir, exist_ok=True)

  runs = [(m, s) for m in args.modes
          for s in (args.max_staleness if m == "pipe" else [0])]
  rows: list[dict] = []
  warm_source = None
  header = {"command": command, "jax": jax.__version__, "backend": jax.default_backend(),
            "num_devices": len(devices), "device_kind": devices[0].device_kind,
            "host_cores": os.cpu_count(), "config_variant": args.config_variant,
            "ppo_steps": args.ppo_steps, "warmup_steps_excluded": args.warmup_steps_excluded,
            "sft_steps": args.sft_steps, "rm_steps": args.rm_steps, "seed": args.seed,
            "shared_warmstart": not args.no_share_warmstart}
  for mode, staleness in runs:
    label = f"pipe_s{staleness}" if mode == "pipe" else mode
    config = make_config(args, mode, staleness)
    layouts, reason = layout_summary(config)
    row = {"label": label, "mode": mode, "max_staleness": staleness if mode == "pipe" else 0}
    if reason is not None:
      print(f"[bench_modes] skip {label}: {len(devices)} devices cannot hold its layouts "
            f"({reason})", flush=True)
      rows.append({**row, "status": f"skipped: {reason}"})
      continue
    if mode != "sequential" and len(devices) == 1:
      print(f"[bench_modes] skip {label}: a single device cannot be split into per-stage "
            "meshes; only sequential is meaningful here", flush=True)
      rows.append({**row, "status": "skipped: one device"})
      continue
    row["devices"] = "/".join(str(layouts[s]["devices"]) for s in STAGES)
    row["layouts"] = layouts
    workdir = fresh_workdir(os.path.join(args.out_dir, label))
    if warm_source is not None:
      shutil.copytree(warm_source, os.path.join(workdir, "warmstart"))
    print(f"[bench_modes] {label}: layouts {json.dumps(layouts)}; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    jax.clear_caches()  # every mode compiles from scratch, in its excluded warm-up steps
    t0 = time.perf_counter()
    result = train(config, workdir, progress=False)
    print(f"[bench_modes] {label}: done in {time.perf_counter() - t0:.1f}s", flush=True)
    if warm_source is None and not args.no_share_warmstart:
      warm_source = os.path.join(workdir, "warmstart")
    rows.append({**row, "status": "ok", **measure(result, config, args.warmup_steps_excluded)})
    header["load_average_end"] = os.getloadavg()[0]

  ok = [r for r in rows if r["status"] == "ok"]
  print()
  print(f"command: {command}")
  print(f"PPO steps {args.ppo_steps} (first {args.warmup_steps_excluded} excluded), "
        f"batch {make_config(args, 'sequential', 0).ppo.batch_size} rollouts/step, "
        f"config variant {args.config_variant or 'full'}")
  if ok:
    print(format_table(ok))
    print(LEGEND)
  for r in rows:
    if r["status"] != "ok":
      print(f"{r['label']}: {r['status']}")
  csv_path, json_path = write_outputs(args.out_dir, rows, header)
  for r in ok:
    print(f"{r['label']}: trace {r['trace']}  gantt {r['gantt']}")
  print(f"wrote {csv_path} and {json_path}")
  if args.page and ok:
    body = "\n".join([
        f"PPO steps {args.ppo_steps} (the first {args.warmup_steps_excluded} excluded: "
        f"compilation), {make_config(args, 'sequential', 0).ppo.batch_size} rollouts per "
        f"step, config variant {args.config_variant or 'full'}; every mode starts from "
        "the same warm start. On a few CPU cores shared by virtual devices the stages "
        "cannot run faster concurrently: this table shows the schedules and their "
        "overlap, not an accelerator's speed-up.", "", format_table(ok), "",
        LEGEND.replace("\n", " "),
        *[f"\n{r['label']}: {r['status']}" for r in rows if r["status"] != "ok"]])
    path = results.write_page(args.page, "Runtime modes side by side", body,
                              results.machine_limits(), command=command)
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
