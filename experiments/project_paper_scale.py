"""PROJECTIONS at paper scale: the planner's best plan and predicted PPO step time for
LLaMA-2-class models on H100 clusters and TPU v5p slices, and the speed-up of `pipe`
(Pipe-RLHF) over `sequential` (a DeepSpeed-Chat-style baseline: one strategy for every
stage, time-shared) and over `per_stage` (a ReaLHF-style baseline: each stage its own
mesh, time-shared).

Nothing here is measured: every number is the planner's prediction (cost model +
simulator) from the hardware profiles of `planner/hardware.py` (datasheet peaks, each
with its source) and the efficiencies of `cost.Efficiency` (the stated defaults unless
`--calibration FILE` gives a file from `planner.calibrate` run on that hardware). The
outputs say so, and name the calibration they rest on.

Grid (defaults): actor + critic (+ reference, + reward model) of LLaMA-2 7B, 13B, 34B
(Code Llama's shape), 70B in bfloat16; H100 SXM nodes of 8 GPUs with 8, 16, 32, 64, 128
GPUs; TPU v5p slices of 8 to 128 chips (4 per host); generation lengths 128 / 512 /
1024 tokens after 512-token prompts; a global batch of 512 prompts per PPO step,
minibatches of 64, one epoch; staleness at most 2 (with a bound s, pipe overlaps at
most s + 1 batches, so 2 is what lets all three stages run at once). For each point and
each mode the search (per-stage Pareto sets over placements, then the simulator) returns
that mode's best plan that fits in memory; "-" where none fits.

  python -m experiments.project_paper_scale [--models llama2-7b,llama2-70b]
      [--targets h100:8,h100:64,tpu-v5p:128] [--gen_lens 128,512,1024]
      [--calibration FILE] [--response_fraction 1.0]
      [--out-dir experiments/out/project_paper_scale]

Writes projections.csv (one row per model x hardware x devices x generation length)
and projections.md (the same as markdown tables, one per model, with the labels).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODES = ("sequential", "per_stage", "pipe")
DEFAULT_MODELS = ("llama2-7b", "llama2-13b", "llama2-34b", "llama2-70b")
DEFAULT_TARGETS = tuple(f"h100:{n}" for n in (8, 16, 32, 64, 128)) + tuple(
    f"tpu-v5p:{n}" for n in (8, 16, 32, 64, 128))
DEFAULT_GEN_LENS = (128, 512, 1024)


@dataclasses.dataclass(frozen=True)
class Setting:
  """The fixed part of every point of the grid."""

  batch_size: int = 512
  minibatch_size: int = 64
  epochs: int = 1
  prompt_len: int = 512
  max_staleness: int = 2  # the plan space's default bound (space.SpaceOptions)
  response_fraction: float = 1.0  # mean response / gen_len (1: every row runs to the end)


def best_per_mode(work, machine, staleness: int) -> dict[str, object]:
  """{mode: the search's best Candidate of that mode, or None when nothing fits}."""
  from pipe_rlhf_jax.planner import search, space
  out = {}
  for mode in MODES:
    options = space.SpaceOptions(modes=(mode,), staleness=tuple(range(staleness + 1)))
    best, _, _ = search.search(work, machine, options, k=1, method="pareto")
    out[mode] = best[0] if best else None
  return out


def project_point(model: str, hw_name: str, devices: int, gen_len: int, machine,
                  setting: Setting = Setting()) -> dict:
  """One row: the chosen plan, its predicted step time and tokens/s, the speed-ups."""
  from pipe_rlhf_jax.planner import presets, space
  hw = machine.hw
  work = space.Workload(actor=presets.model(model), batch_size=setting.batch_size,
                        minibatch_size=setting.minibatch_size, epochs=setting.epochs,
                        prompt_len=setting.prompt_len, gen_len=gen_len, num_devices=devices,
                        devices_per_host=min(hw.devices_per_host, devices),
                        response_fraction=setting.response_fraction)
  start = time.perf_counter()
  best = best_per_mode(work, machine, setting.max_staleness)
  step = {m: (c.step_time if c is not None else math.inf) for m, c in best.items()}
  chosen_mode = min(MODES, key=lambda m: step[m])
  chosen = best[chosen_mode]

  def speedup(base: str) -> float:
    if math.isinf(step["pipe"]) or math.isinf(step[base]):
      return math.nan
    return step[base] / step["pipe"]

  row = {"model": model, "hardware": hw_name, "devices": devices, "gen_len": gen_len,
         "batch_size": setting.batch_size, "prompt_len": setting.prompt_len,
         **{f"{m}_step_s": step[m] for m in MODES},
         "pipe_over_sequential": speedup("sequential"),
         "pipe_over_per_stage": speedup("per_stage"),
         "search_s": time.perf_counter() - start}
  if chosen is None:
    row.update(chosen_plan="does not fit", step_s=math.inf, tokens_per_s=0.0,
               bottleneck="-", gib_per_device=math.nan)
  else:
    row.update(chosen_plan=str(chosen.plan) + (f" remat={chosen.plan.train.remat}"
                                               if chosen.plan.train.remat != "none" else ""),
               step_s=chosen.step_time,
               tokens_per_s=setting.batch_size * gen_len / chosen.step_time,
               bottleneck=chosen.bottleneck,
               gib_per_device=max(chosen.memory.values()) / 2 ** 30)
  return row


def _fmt(x, spec: str) -> str:
  if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
    return "-"
  return format(x, spec)


def markdown(rows: list[dict], label: str) -> str:
  """The rows as one markdown table per model, headed by the projection label."""
  out = ["# PROJECTIONS (not measured): PPO step time at paper scale", "", label, ""]
  for model in dict.fromkeys(r["model"] for r in rows):
    out += [f"## {model}", "",
            "| hardware | devices | gen len | chosen plan | s/step | generated tok/s | "
            "pipe vs sequential | pipe vs per_stage | GiB/dev |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["model"] == model):
      out.append(f"| {r['hardware']} | {r['devices']} | {r['gen_len']} | "
                 f"`{r['chosen_plan']}` | {_fmt(r['step_s'], '.3g')} | "
                 f"{_fmt(r['tokens_per_s'], ',.0f')} | "
                 f"{_fmt(r['pipe_over_sequential'], '.2f')}x | "
                 f"{_fmt(r['pipe_over_per_stage'], '.2f')}x | "
                 f"{_fmt(r['gib_per_device'], '.1f')} |")
    out.append("")
  return "\n".join(out)


def run(models, targets, gen_lens, calibration: str, out_dir: str,
        setting: Setting = Setting()) -> tuple[list[dict], str]:
  """Projects every point of the grid; writes the CSV and markdown; returns (rows, label)."""
  from pipe_rlhf_jax.planner import cost, hardware
  eff = cost.Efficiency.load(calibration) if calibration else cost.Efficiency()
  label = (f"PROJECTION from the planner's analytic cost model and simulator: hardware "
           f"profiles of pipe_rlhf_jax/planner/hardware.py (datasheet peaks); efficiencies "
           f"{eff.source}: matmul {eff.matmul}, train {eff.train}, decode_bw "
           f"{eff.decode_bw}, tick overhead {eff.tick_overhead_s * 1e6:.0f} us, call "
           f"overhead {eff.call_overhead_s * 1e6:.0f} us. Batch {setting.batch_size} "
           f"prompts of {setting.prompt_len} tokens, minibatch {setting.minibatch_size}, "
           f"{setting.epochs} epoch, staleness <= {setting.max_staleness}, mean response "
           f"{setting.response_fraction:.2f} of the generation length; every row is "
           "a prediction, none was measured.")
  print(label, flush=True)
  rows = []
  for model in models:
    for target in targets:
      hw_name, devices = target.split(":")
      machine = cost.Machine(hardware.get(hw_name), eff)
      for gen_len in gen_lens:
        row = project_point(model, hw_name, int(devices), gen_len, machine, setting)
        rows.append(row)
        print(f"{model} {hw_name} x {devices} gen {gen_len}: {_fmt(row['step_s'], '.3g')}"
              f" s/step, pipe/seq {_fmt(row['pipe_over_sequential'], '.2f')}x, pipe/"
              f"per_stage {_fmt(row['pipe_over_per_stage'], '.2f')}x "
              f"({row['search_s']:.1f} s) {row['chosen_plan']}", flush=True)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "projections.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  with open(os.path.join(out_dir, "projections.md"), "w") as f:
    f.write(markdown(rows, label) + "\n")
  return rows, label


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
  parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                      help="hardware:devices, comma separated")
  parser.add_argument("--gen_lens", default=",".join(map(str, DEFAULT_GEN_LENS)))
  parser.add_argument("--calibration", default="",
                      help="a planner.calibrate JSON from the target hardware")
  parser.add_argument("--response_fraction", type=float, default=1.0,
                      help="mean response length / generation length (early EOS)")
  parser.add_argument("--out-dir", default=os.path.join(_ROOT, "experiments", "out",
                                                        "project_paper_scale"))
  args = parser.parse_args(argv)
  run(args.models.split(","), args.targets.split(","),
      [int(g) for g in args.gen_lens.split(",")], args.calibration, args.out_dir,
      Setting(response_fraction=args.response_fraction))


if __name__ == "__main__":
  main()
