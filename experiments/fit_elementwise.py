"""Experiment: fit the planner's non-matmul term across model sizes, SmolLM2-135M held out.

Owns one fit: the passes per activation element of each stage (`cost.ELEMENTWISE`, the
defaults of `cost.Efficiency`). At each toy size of `experiments.shapes.SIZES`
(`--sizes`) the real PPO stages run (`common.bench_size`: `PPOSystem`, sequential, one
device, f32, the library's stage plans) and the machine's rates are probed in the same
process on the stage's own matmul shapes and optimizer step (`common.probed_machine`),
so what the cost model misses at those rates is work its FLOP and byte
counts leave out (a size whose probes ran on a busier host than its stages is dropped:
`consistent`). Per stage the measured seconds are set against the cost model with the
term off and the term's seconds at one pass (`cost.StageTerms.elementwise`), and
`calibrate.fit_elementwise` fits the passes (relative least squares, one number per
stage). The held-out check prices SmolLM2-135M (never in the fit,
`calibrate.heldout_split`) with and without the fitted term against its measured step:
the row `bench_ppo_step --shapes` recorded (`--heldout-row`, a line of its JSONL), or by
default the measurement on docs/results/real_shapes.md (commit 7e4398cbf8d1; its stage
seconds, matmul peak, bandwidth and probed efficiencies as printed there).

Usage:
  python -m experiments.fit_elementwise --sizes 2,3,4 --steps 2
  python -m experiments.fit_elementwise --samples experiments/out/fit_elementwise/samples.jsonl

Each size's samples are appended to samples.jsonl as it finishes (a run cut short keeps
them; `--samples` refits from that file without measuring); the fit and the check go to
experiments/out/fit_elementwise/fit.json and are printed.
Timings on a shared machine are noisy: run it alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from pipe_rlhf_jax.host_devices import use_memory_lean_scheduler

# Before jax starts its backend, as in the held-out measurement (bench_ppo_step --shapes).
use_memory_lean_scheduler()

from experiments import common, results
from experiments.shapes import SIZES
from pipe_rlhf_jax.models import tiny_config
from pipe_rlhf_jax.models.shapes import config as shape_config
from pipe_rlhf_jax.planner import calibrate, cost, hardware

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = common.STAGES
HELD_OUT = "smollm2-135m"
# SmolLM2-135M as docs/results/real_shapes.md recorded it (commit 7e4398cbf8d1, AMD EPYC
# 2 cores, batch 8, prompt 64, new tokens 64): measured stage seconds, the machine's
# limits and the efficiencies probed in that run.
RECORDED = {"shape": HELD_OUT, "batch": 8, "prompt_len": 64, "new_tokens": 64,
            "generate_s": 4.672, "infer_s": 2.987, "train_s": 9.894, "step_s": 17.555,
            "limits": {"matmul_gflops": 202.2, "mem_gbps": 52.3},
            "planner_probed_efficiency": {"matmul": 1.00, "train": 1.00, "decode_bw": 0.31,
                                          "optimizer_bw": 0.59}}
OUT_DIR = os.path.join(_ROOT, "experiments", "out", "fit_elementwise")


def without_term(eff: cost.Efficiency, passes: float = 0.0) -> cost.Efficiency:
  """`eff` with every stage's passes per activation element set to `passes`."""
  return dataclasses.replace(eff, **{n: passes for n in cost.ELEMENTWISE.values()})


def stage_samples(shape: str, cfg, plan, batch, prompt, gen, measured: dict,
                  machine: cost.Machine) -> list[dict]:
  """One sample per stage: measured seconds, the cost model's with the term off, and the
  term's seconds at one pass (the difference of the model at one pass and at none)."""
  off = common.planner_prediction(cfg, plan, batch, prompt, gen,
                               cost.Machine(machine.hw, without_term(machine.eff)))
  one = common.planner_prediction(cfg, plan, batch, prompt, gen,
                               cost.Machine(machine.hw, without_term(machine.eff, 1.0)))
  return [{"shape": shape, "stage": s, "seconds": measured[s],
           "predicted": off[f"planner_{s}_s"],
           "elementwise": one[f"planner_{s}_s"] - off[f"planner_{s}_s"]} for s in STAGES]


def measure_size(size: int, steps: int, limits: dict) -> list[dict]:
  layers, embed, heads, kv, mlp, vocab, batch, prompt, gen = SIZES[size]
  cfg = tiny_config(vocab_size=vocab, embed_dim=embed, num_layers=layers, num_heads=heads,
                    num_kv_heads=kv, head_dim=embed // heads, mlp_dim=mlp)
  row = common.bench_size(size, steps + 1, 1, 0)
  row["decode_shapes_gbps"] = common.weight_rate(
      common.decode_shapes(cfg, batch), cfg.dtype)
  row.update(common.optimizer_seconds(cfg))
  machine = common.probed_machine(cfg, batch, prompt, gen, row, limits)
  plan = common.plan_for("sequential", common.stage_plans())
  out = stage_samples(f"size{size}", cfg, plan, batch, prompt, gen,
                      {s: row[f"{s}_s"] for s in STAGES}, machine)
  for o in out:
    o["step_s"] = row["s_per_step"]
  return out


def consistent(samples: list[dict]) -> tuple[list[dict], list[str]]:
  """(kept samples, dropped runs): a run of one size (its three stages, measured with its
  own probes) is dropped where the model without the term prices every stage slower than
  measured. The term-free model leaves work out, so at the probed rates it is below the
  measured stage; above it in all three stages, the probes ran while the shared host was
  busier than during the stages (the probe peak of such a run read 21.6 GFLOP/s, against
  38-61 in the kept ones and 205 on a quiet host), and the run says nothing about the
  term."""
  runs: dict[tuple, list[dict]] = {}
  for s in samples:
    runs.setdefault((s["shape"], json.dumps(s.get("limits"), sort_keys=True)), []).append(s)
  kept, dropped = [], []
  for (shape, limits), rows in runs.items():
    if all(r["predicted"] > r["seconds"] for r in rows):
      dropped.append(f"{shape} (probes {limits})")
    else:
      kept += rows
  return kept, dropped


def held_out_machine(row: dict, eff: dict | None) -> cost.Machine:
  """The cpu profile at `row`'s limits: its probed efficiencies (`eff`), or the
  profile's assumed ones (None)."""
  limits = row["limits"]
  base = cost.Efficiency(**eff) if eff is not None else cost.Efficiency()
  return cost.Machine(hardware.get("cpu"), dataclasses.replace(
      base, host_peak_flops=limits["matmul_gflops"] * 1e9, hbm_bw=limits["mem_gbps"] * 1e9))


def held_out_check(row: dict, passes: dict[str, float]) -> dict:
  """Predicted against measured step of the held-out row, with and without the term,
  with probed and with assumed efficiencies."""
  cfg = shape_config(row["shape"], dtype="float32")
  plan = common.plan_for("sequential", common.stage_plans())
  out = {"measured_step_s": row["step_s"],
         "measured": {s: row[f"{s}_s"] for s in STAGES}}
  for name, eff in (("probed", row["planner_probed_efficiency"]), ("assumed", None)):
    machine = held_out_machine(row, eff)
    for term, e in (("without", without_term(machine.eff)),
                    ("with", dataclasses.replace(without_term(machine.eff), **passes))):
      pred = common.planner_prediction(cfg, plan, row["batch"], row["prompt_len"],
                                    row["new_tokens"], cost.Machine(machine.hw, e))
      key = f"{name}_{term}"
      out[key] = {s: pred[f"planner_{s}_s"] for s in STAGES}
      out[key]["step"] = pred["planner_step_s"]
      out[key]["error"] = abs(pred["planner_step_s"] - row["step_s"]) / row["step_s"]
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes", default="2,3,4")
  parser.add_argument("--steps", type=int, default=2, help="timed steps (after a compile)")
  parser.add_argument("--heldout-row", default="",
                      help="a bench_ppo_step --shapes JSONL file; its last smollm2-135m row is "
                      "the held-out measurement (default: the recorded one)")
  parser.add_argument("--samples", default="",
                      help="refit from a samples.jsonl this script wrote, measuring nothing")
  parser.add_argument("--out-dir", default=OUT_DIR)
  args = parser.parse_args(argv)
  os.makedirs(args.out_dir, exist_ok=True)
  if args.samples:
    with open(args.samples) as f:
      samples = [json.loads(line) for line in f if line.strip()]
  else:
    limits = results.machine_limits()
    print(f"matmul peak {limits['matmul_gflops']:.1f} GFLOP/s, memory "
          f"{limits['mem_gbps']:.1f} GB/s", flush=True)
    samples = []
    for size in [int(s) for s in args.sizes.split(",")]:
      new = measure_size(size, args.steps, limits)
      samples += new
      for s in new:
        s["limits"] = limits
        results.record_row(args.out_dir, "samples", s)
  row = RECORDED
  if args.heldout_row:
    with open(args.heldout_row) as f:
      row = [json.loads(line) for line in f if line.strip()][-1]
  fit_rows, check_rows = calibrate.heldout_split(samples, HELD_OUT)
  assert not check_rows, "the held-out model is never measured for the fit"
  everything = calibrate.fit_elementwise(fit_rows)
  fit_rows, dropped = consistent(fit_rows)
  for d in dropped:
    print(f"dropped: {d}: the model without the term is above every measured stage")
  passes = calibrate.fit_elementwise(fit_rows)
  print("fit over every sample, none dropped:",
        ", ".join(f"{k} {v:.1f}" for k, v in everything.items()),
        f"(held out: step {held_out_check(row, everything)['probed_with']['step']:.3f} s)")
  check = held_out_check(row, passes)
  print("fitted passes per activation element:",
        ", ".join(f"{k} {v:.1f}" for k, v in passes.items()))
  for s in fit_rows:
    name = cost.ELEMENTWISE[s["stage"]]
    with_term = s["predicted"] + passes.get(name, 0.0) * s["elementwise"]
    print(f"  {s['shape']} {s['stage']}: measured {s['seconds']:.3f} s, model "
          f"{s['predicted']:.3f} s without the term, {with_term:.3f} s with it")
  print(f"held out {HELD_OUT}: measured step {check['measured_step_s']:.3f} s")
  for key in ("probed_without", "probed_with", "assumed_without", "assumed_with"):
    c = check[key]
    print(f"  {key.replace('_', ' efficiencies, ', 1)} the term: "
          + " / ".join(f"{s} {c[s]:.3f}" for s in STAGES)
          + f"; step {c['step']:.3f} s, error {c['error']:.0%}")
  path = os.path.join(args.out_dir, "fit.json")
  with open(path, "w") as f:
    json.dump({"samples": samples, "dropped": dropped, "passes": passes,
               "passes_without_dropping": everything, "held_out": check,
               "held_out_row": row}, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
