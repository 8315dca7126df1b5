"""The planner's own error: predicted vs measured steady seconds per PPO step, on this machine.

For a tiny model on the 8 virtual CPU devices, a set of plans spanning the three modes,
several meshes per stage, generation micro-batches M in {1, P, 2P} and staleness 0/1/2 is
(1) priced by the planner (cost model with efficiencies calibrated here, in this process,
by `planner.calibrate`, then the simulator), and (2) run by the real system
(`pipe_rlhf_jax.system.run`, random-init actor/critic, a rule reward): every plan is
built and warmed up (compiles) first, then measured in `--repeats` rounds, each round
running `--window` steps of every plan in a fresh random order. A repeat's steady seconds
per step is the mean gap between consecutive step completions (the end of each batch's
last span); the spread over repeats is reported.

Why rounds: a CPU host's speed drifts by +-15% over minutes (a 1024^2 matmul measured
170-230 GFLOP/s within one minute, with nothing else running), and the same plan measured
0.22-0.36 s/step in runs minutes apart. Measured one plan after another, in mode order,
that drift lands on whole modes and reads as model error; in interleaved rounds every plan
sees the same mix of fast and slow moments. Before each window a fixed matmul probe
records the host's speed (`host_gflops` per repeat in the CSV, its range in the summary):
reported, never used to rescale the measurements.

Reports mean / max absolute percentage error, Spearman rank correlation, and how the plan
the planner ranks first measures against the best measured plan. Writes
experiments/out/planner_accuracy/{accuracy.csv, summary.json, scatter.png}.

  python -m experiments.planner_accuracy [--plans 20] [--window 3] [--warmup 2] [--repeats 5]
  # the current model against an earlier run's measurements, measuring nothing:
  python -m experiments.planner_accuracy --calibration OUT/calibration_samples.json \
      --measured OUT/accuracy.csv
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from pipe_rlhf_jax.host_devices import (  # noqa: E402
  use_memory_lean_scheduler,
  use_virtual_cpu_devices,
)

use_virtual_cpu_devices()
use_memory_lean_scheduler()

import numpy as np  # noqa: E402

from experiments import results  # noqa: E402


def spearman(a, b) -> float:
  ra = np.argsort(np.argsort(a))
  rb = np.argsort(np.argsort(b))
  return float(np.corrcoef(ra, rb)[0, 1])


def scores(rows: list[dict]) -> dict:
  """Mean / max absolute percentage error, Spearman, and the pick against the best, over
  rows with "plan", "predicted_s" and "measured_s"."""
  pred = np.array([r["predicted_s"] for r in rows])
  meas = np.array([r["measured_s"] for r in rows])
  ape = np.abs(pred - meas) / meas
  picked, best = rows[int(np.argmin(pred))], rows[int(np.argmin(meas))]
  return {"mape": float(ape.mean()), "max_ape": float(ape.max()),
          "spearman": spearman(pred, meas),
          "picked_plan": picked["plan"], "picked_measured_s": picked["measured_s"],
          "best_measured_plan": best["plan"], "best_measured_s": best["measured_s"],
          "picked_vs_best": picked["measured_s"] / best["measured_s"] - 1}


def choose_plans(work, count: int):
  """A spread of valid plans: every mode, several meshes, M in {1, P, 2P}, staleness."""
  from pipe_rlhf_jax.planner import space
  options = space.SpaceOptions(staleness=(0, 1, 2), train_remat=("none",),
                               microbatch_factors=(0, 1, 2))
  plans = list(space.enumerate_plans(work, options))
  rng = np.random.default_rng(0)
  by_mode = {m: [p for p in plans if p.mode == m] for m in ("sequential", "per_stage", "pipe")}
  quota = {"sequential": max(1, count * 3 // 20), "per_stage": max(1, count // 4)}
  quota["pipe"] = count - quota["sequential"] - quota["per_stage"]
  chosen = []
  for mode, k in quota.items():
    pool = by_mode[mode]
    idx = rng.choice(len(pool), size=min(k, len(pool)), replace=False)
    chosen += [pool[i] for i in sorted(idx)]
  return chosen


def build_plan(plan, cfg, work, tokenizer, texts, warmup: int):
  """The plan's system and prompt source, compiled and warmed up by `warmup` steps."""
  from pipe_rlhf_jax.config import PPOSettings
  from pipe_rlhf_jax.generation.sampler import SamplingSettings
  from pipe_rlhf_jax.models.transformer import init_model
  from pipe_rlhf_jax.system.api import prompts_from_texts, run
  from pipe_rlhf_jax.system.system import Models, PPOSystem
  system = PPOSystem(
      Models.from_policy(init_model(cfg)),
      ppo=PPOSettings(steps=1000, batch_size=work.batch_size,
                    minibatch_size=work.minibatch_size, epochs=work.epochs),
      sampling=SamplingSettings(max_new_tokens=work.gen_len, eos_id=None,
                              pad_id=tokenizer.pad_id),
      plan=plan, reward_fn=lambda p, c: [float(len(x)) for x in c],
      decode=tokenizer.decode)
  prompts = prompts_from_texts(texts, tokenizer, work.batch_size, work.prompt_len)
  run(system, prompts, steps=warmup)
  return system, prompts


def measure_window(system, prompts, window: int) -> tuple[float, dict[str, list[float]]]:
  """Steady seconds per step over `window` steps, and every stage span's duration."""
  from pipe_rlhf_jax.concurrency import tracing
  from pipe_rlhf_jax.system.api import run
  tracer = run(system, prompts, steps=window).tracer
  done = tracing.completion_times(tracer)
  spans: dict[str, list[float]] = {}
  for span in tracer.spans():
    spans.setdefault(span.stage, []).append(span.duration)
  return (done[-1] - done[0]) / (len(done) - 1), spans


def host_probe(seconds: float = 0.3) -> float:
  """GFLOP/s of a fixed 1024^2 f32 matmul over all devices' shared cores, now."""
  import jax
  import jax.numpy as jnp
  f = _PROBE.setdefault("f", jax.jit(lambda a: a @ a))
  a = _PROBE.setdefault("a", jnp.ones((1024, 1024), jnp.float32))
  f(a).block_until_ready()
  start, n = time.perf_counter(), 0
  while time.perf_counter() - start < seconds:
    f(a).block_until_ready()
    n += 1
  return 2 * 1024 ** 3 * n / (time.perf_counter() - start) / 1e9


_PROBE: dict = {}


def reprice(plans, work, machine, measured_csv: str, out_dir: str) -> None:
  """The current model's predictions against an earlier run's measurements."""
  from pipe_rlhf_jax.planner import search
  with open(measured_csv, newline="") as f:
    measured = {r["plan"]: float(r["measured_s"]) for r in csv.DictReader(f)
                if not r["error"]}
  rows = [{"plan": str(p), "mode": p.mode,
           "predicted_s": search.price(p, work, machine, simulate=True).step_time,
           "measured_s": measured[str(p)]} for p in plans if str(p) in measured]
  summary = {"measured_in": measured_csv, "plans": len(rows), **scores(rows),
             "by_mode_mape": {mode: float(np.mean([
                 abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"]
                 for r in rows if r["mode"] == mode]))
                 for mode in sorted({r["mode"] for r in rows})}}
  with open(os.path.join(out_dir, "repriced.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  with open(os.path.join(out_dir, "repriced_summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  print(json.dumps(summary, indent=1))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--plans", type=int, default=20)
  results.add_page_flag(parser, "planner_accuracy")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--window", type=int, default=3)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--quick-calibration", action="store_true")
  parser.add_argument("--calibration", default="",
                      help="a `planner.calibrate` JSON of this model on this machine: refit "
                           "from its samples instead of measuring them again")
  parser.add_argument("--measured", default="",
                      help="an accuracy.csv of an earlier run: price its plans with the "
                           "current model (and --calibration) against its measurements, "
                           "measuring nothing")
  parser.add_argument("--out-dir", default=os.path.join(_ROOT, "experiments", "out",
                                                        "planner_accuracy"))
  args = parser.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)

  from pipe_rlhf_jax.models.config import EXECUTION_FIELDS, tiny_config
  from pipe_rlhf_jax.models.load import load_tokenizer
  from pipe_rlhf_jax.planner import calibrate, cost, hardware, search, space

  tokenizer = load_tokenizer("byte")
  vocab = -(-tokenizer.vocab_size // 8) * 8
  cfg = tiny_config(vocab_size=vocab, embed_dim=64, num_layers=4, num_heads=4,
                    num_kv_heads=2, head_dim=16, mlp_dim=192)
  work = space.Workload(actor=cfg, batch_size=32, minibatch_size=16, epochs=1,
                        prompt_len=16, gen_len=8, num_devices=8, reward_model=False)
  texts = [f"rev {chr(97 + i % 26)}{chr(97 + (i * 7) % 26)}{i}=" for i in range(256)]
  plans = choose_plans(work, args.plans)
  # Compiling every plan first puts the calibration and the measurements minutes apart,
  # not the half hour the compiles take, so host drift between them stays small.
  if args.measured and not args.calibration:
    raise SystemExit("--measured needs --calibration: the calibration samples of the run "
                     "that measured them.")
  built, failed = {}, {}
  for i, plan in enumerate([] if args.measured else plans):
    t0 = time.time()
    try:
      built[i] = build_plan(plan, cfg, work, tokenizer, texts, args.warmup)
    except Exception as e:  # a plan the plan refuses: recorded, not hidden
      print(f"[{i}] {plan}: FAILED {type(e).__name__}: {e}", flush=True)
      failed[i] = str(e)
      continue
    print(f"[{i}] built and warmed up in {time.time() - t0:.0f} s: {plan}", flush=True)

  start = time.time()
  calibration_probes = [host_probe()]
  if args.calibration:
    with open(args.calibration) as f:
      samples = json.load(f)
    samples = samples.get("samples", samples)
    # Execution fields (how the model is computed) are not the model; samples saved
    # before a field existed lack it.
    shape = lambda d: {k: v for k, v in d.items() if k not in EXECUTION_FIELDS}
    if shape(samples.get("model", {})) != shape(json.loads(json.dumps(
        dataclasses.asdict(cfg)))):
      raise SystemExit(f"{args.calibration} was measured on another model.")
  else:
    samples = calibrate.measure(cfg, quick=args.quick_calibration)
    with open(os.path.join(args.out_dir, "calibration_samples.json"), "w") as f:
      json.dump(samples, f, indent=1)
  calibration_probes.append(host_probe())
  fits = calibrate.fit(samples)
  eff = cost.Efficiency(**{k: v for k, v in calibrate.efficiency_dict(
      fits, "calibrated in planner_accuracy").items()})
  print("calibration:", {k: round(v, 6) for k, (v, _) in fits.items()},
        f"({time.time() - start:.0f} s)", flush=True)
  machine = cost.Machine(hardware.get("cpu"), eff)
  if args.measured:
    reprice(plans, work, machine, args.measured, args.out_dir)
    return
  priced, rows = {}, {}
  for i, plan in enumerate(plans):
    cand = search.price(plan, work, machine, simulate=True)
    # Each stage's mean span in the simulated run (pipe: slowed by the stages it shares
    # the host with), the counterpart of the measured spans; the solo seconds are
    # `{stage}_s`.
    sim = search.simulate_plan(plan, cand.cost, machine)
    sim_spans = {}
    for span in sim.tracer.spans():
      if span.batch is not None and span.batch >= 8:  # the steady part
        sim_spans.setdefault(span.stage, []).append(span.duration)
    priced[i] = (cand, {stage: float(np.mean(d)) for stage, d in sim_spans.items()})
    if i in failed:
      rows[i] = {"plan": str(plan), "mode": plan.mode, "predicted_s": cand.step_time,
                 "measured_s": float("nan"), "spread": float("nan"), "error": failed[i]}

  periods = {i: [] for i in built}
  spans = {i: {} for i in built}
  probes = {i: [] for i in built}
  order_rng = np.random.default_rng(1)
  for r in range(args.repeats):
    for i in order_rng.permutation(sorted(built)):
      i = int(i)
      probes[i].append(host_probe())
      period, window_spans = measure_window(*built[i], args.window)
      periods[i].append(period)
      for stage, d in window_spans.items():
        spans[i].setdefault(stage, []).extend(d)
    print(f"round {r + 1}/{args.repeats} done", flush=True)

  for i in built:
    plan, (cand, sim_spans) = plans[i], priced[i]
    measured = float(np.mean(periods[i]))
    mean_spans = {stage: float(np.mean(d)) for stage, d in spans[i].items()}
    rows[i] = {"plan": str(plan), "mode": plan.mode, "predicted_s": cand.step_time,
               "measured_s": measured,
               "spread": float((max(periods[i]) - min(periods[i])) / measured),
               "generate_s": cand.cost.stage("generate"), "infer_s": cand.cost.stage("infer"),
               "train_s": cand.cost.stage("train"), "sync_s": cand.cost.sync,
               "repeats": " ".join(f"{p:.4f}" for p in periods[i]),
               "host_gflops": " ".join(f"{g:.0f}" for g in probes[i]), "error": "",
               **{f"simulated_{stage}_s": v for stage, v in sim_spans.items()},
               **{f"measured_{stage}_s": v for stage, v in mean_spans.items()}}
    stages = " ".join(f"{s[:3]} {cand.cost.stage(s):.3f}/"
                      f"{sim_spans.get(s, 0):.3f}/{mean_spans.get(s, 0):.3f}"
                      for s in ("generate", "infer", "train"))
    print(f"[{i}] predicted {cand.step_time:.3f} s measured {measured:.3f} s "
          f"(spread {rows[i]['spread']:.0%}; solo/simulated/measured {stages}) {plan}",
          flush=True)
  rows = [rows[i] for i in sorted(rows)]
  all_probes = [g for i in probes for g in probes[i]]
  ok = [r for r in rows if not r["error"]]
  pred = np.array([r["predicted_s"] for r in ok])
  meas = np.array([r["measured_s"] for r in ok])
  summary = {"plans": len(rows), "measured": len(ok), **scores(ok),
             "host_gflops_range": [float(min(all_probes)), float(max(all_probes))],
             "host_gflops_at_calibration": calibration_probes,
             "calibration": {k: v for k, (v, _) in fits.items()}}
  with open(os.path.join(args.out_dir, "accuracy.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
    writer.writeheader()
    writer.writerows(rows)
  with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5, 5))
  for mode, marker in (("sequential", "s"), ("per_stage", "^"), ("pipe", "o")):
    sel = [r for r in ok if r["mode"] == mode]
    ax.scatter([r["measured_s"] for r in sel], [r["predicted_s"] for r in sel],
               marker=marker, label=mode)
  lim = [0, max(pred.max(), meas.max()) * 1.1]
  ax.plot(lim, lim, "k--", lw=0.8)
  ax.set_xlabel("measured s/step")
  ax.set_ylabel("predicted s/step")
  ax.set_title(f"MAPE {summary['mape']:.0%}, max {summary['max_ape']:.0%}, "
               f"Spearman {summary['spearman']:.2f}")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(args.out_dir, "scatter.png"))
  print(json.dumps({k: v for k, v in summary.items() if k != "calibration"}, indent=1))
  if args.page:
    write_results_page(args.page, rows, summary, os.path.join(args.out_dir, "scatter.png"))


def write_results_page(name: str, rows: list[dict], summary: dict, scatter: str) -> None:
  """docs/results/<name>.md: the error over the plans, each plan's predicted and measured
  seconds, the scatter plot beside it, and the run's provenance."""
  import shutil

  os.makedirs(results.RESULTS_DIR, exist_ok=True)
  shutil.copyfile(scatter, os.path.join(results.RESULTS_DIR, f"{name}.png"))
  lo, hi = summary["host_gflops_range"]
  lines = [
      f"Over {summary['measured']} plans of the three modes: mean absolute percentage "
      f"error **{summary['mape']:.0%}**, max {summary['max_ape']:.0%}, Spearman rank "
      f"correlation {summary['spearman']:.2f}; the plan the planner ranks first measures "
      f"{summary['picked_vs_best']:+.0%} against the best measured plan.", "",
      f"![predicted against measured seconds per step]({name}.png)", "",
      "Each plan is priced by the cost model with efficiencies calibrated in the same "
      "process, then the simulator; measured by the system in interleaved rounds (the "
      f"host's 1024^2 matmul probe read {lo:.0f}-{hi:.0f} GFLOP/s across the rounds).", "",
      "| plan | predicted s/step | measured s/step (spread) |", "|---|---|---|"]
  for r in rows:
    if r["error"]:
      lines.append(f"| {r['plan']} | – | failed: {r['error'][:80]} |")
    else:
      lines.append(f"| {r['plan']} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} "
                   f"({r['spread']:.0%}) |")
  fits = ", ".join(f"{k} {v:.4g}" for k, v in summary["calibration"].items())
  lines += ["", f"Fitted constants: {fits}."]
  path = results.write_page(name, "The planner's error", "\n".join(lines),
                            results.machine_limits())
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
