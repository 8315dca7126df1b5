"""The prepared accelerator check: one run against the chip's measured limits and the planner.

Owns one run of `common.bench_shape` per shape and mode, on one
device, in the run's dtype (bf16 on an accelerator): it measures the chip's matmul peak in
that dtype and its memory bandwidth (`results.machine_limits`), then for each shape of
`--shapes` writes one random-weight Hugging Face directory and runs one compile step and
`--steps` timed PPO steps in each mode of `--modes` (`sequential` and `per_stage` fit one
device; `pipe` gives each stage a device of its own and runs only where three exist). Per
row it reports the step's seconds beside the planner's prediction
(`planner.search.price` on the hardware profile of `--hardware`), the model FLOP
utilisation (the step's FLOPs, `models/flops.py`, over its seconds, as a fraction of the
measured peak), each stage's achieved FLOP/s, decode tokens/s against the bandwidth
roofline (the bytes of weights and KV cache each token step reads, over the measured
bandwidth), and memory: XLA's `memory_analysis()` of the stage functions, the planner's
model and the device's peak bytes in use. The measured limits are set beside the
profile's datasheet figures.

`--smoke` is a tiny size that runs on a CPU in about a minute: 2 layers of
smollm2-135m, batch 2, 8 prompt and 4 new tokens, f32, the `cpu` profile.

Usage:
  python -m experiments.device_check --page
  python -m experiments.device_check --smoke --page

Writes experiments/out/device_check/<shape>.jsonl (one row per shape, mode and run, each
as soon as it is measured) and, with --page, docs/results/device_check.md. A mode that
fails leaves a row with its error, the other modes still run, and the exit status is 1. A
mode that would end past `--budget-s` (by the longest mode so far) is left out and named
on the page, so that the run ends inside its time.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import tempfile
import time
import traceback

from pipe_rlhf_jax.host_devices import use_memory_lean_scheduler

# Before jax starts its backend, as in bench_ppo_step --shapes, whose measurement this runs.
use_memory_lean_scheduler()

import jax

from experiments import common, results
from pipe_rlhf_jax.planner import hardware

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = common.STAGES
MODES = ("sequential", "per_stage", "pipe")
OUT_DIR = os.path.join(_ROOT, "experiments", "out", "device_check")
MIB = 2**20

# Sizes of a full run (one accelerator) and of `--smoke` (a CPU).
FULL = {"shapes": "qwen2.5-0.5b,qwen3-0.6b", "layers": 0, "steps": 2, "batch": 32,
        "prompt_len": 128, "new_tokens": 128, "matmul_n": 8192, "stream_mib": 2048}
SMOKE = {"shapes": "smollm2-135m", "layers": 2, "steps": 1, "batch": 2, "prompt_len": 8,
         "new_tokens": 4, "matmul_n": 1024, "stream_mib": 64, "dtype": "float32",
         "hardware": "cpu"}


def default_hardware(device) -> str:
  """The planner profile of `device`: `cpu` on a CPU, the GPU its kind names (H200, H100,
  A100); any other accelerator needs `--hardware`."""
  if device.platform == "cpu":
    return "cpu"
  kind = device.device_kind.lower()
  for name, profile in (("h200", "h200"), ("h100", "h100"), ("a100", "a100-80gb")):
    if name in kind:
      return profile
  raise SystemExit(f"no planner profile is known for {device.device_kind!r}; pass "
                   f"--hardware (one of {', '.join(sorted(hardware.PROFILES))}).")


def fitting_modes(num_devices: int) -> tuple[list[str], dict[str, str]]:
  """The modes that fit `num_devices`, and why each other one does not."""
  fit, skipped = [], {}
  plans = common.stage_plans(1)
  for mode in MODES:
    needed = common.devices_needed(common.plan_for(mode, plans))
    if needed <= num_devices:
      fit.append(mode)
    else:
      skipped[mode] = (f"needs {needed} devices (each stage a block of its own, "
                       f"plan.placement); {num_devices} exist")
  return fit, skipped


def device_peak_mib() -> float:
  """The device's peak bytes in use so far in this process (MiB; NaN where the backend
  keeps no statistics, as the CPU's)."""
  stats = jax.devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return peak / MIB if peak is not None else math.nan


def derived(row: dict, limits: dict) -> dict:
  """What the check reads off a `bench_shape` row: MFU, decode against its roofline and
  the planner's error."""
  peak, bw = limits["matmul_gflops"] * 1e9, limits["mem_gbps"] * 1e9
  step_flops = sum(row[f"{s}_flops"] for s in STAGES)
  tokens = row["batch"] * row["new_tokens"]
  decode_bytes = row["decode_bytes_per_token_step"] * row["new_tokens"]
  return {"step_flops": step_flops,
          "mfu": step_flops / row["step_s"] / peak,
          "decode_tokens_per_s": tokens / row["generate_s"],
          "decode_roofline_tokens_per_s": tokens / (decode_bytes / bw),
          "planner_step_ratio": row["planner_step_s"] / row["step_s"]}


class Budget:
  """The run's seconds: whether one more mode, as long as the longest so far, still fits."""

  def __init__(self, seconds: float, start: float):
    self.seconds = seconds
    self.deadline = start + seconds
    self.longest = 0.0

  def fits(self) -> bool:
    return time.perf_counter() + self.longest <= self.deadline

  def why_not(self) -> str:
    return (f"it would pass --budget-s {self.seconds:.0f} (the longest mode so far took "
            f"{self.longest:.0f} s)")


def check_shape(shape: str, modes: list[str], args, limits, budget: Budget,
                skipped: dict[str, str]):
  """Yields one row per mode of `shape`, from one random-weight checkpoint.

  A mode that does not fit `budget` is left out and named in `skipped`, so that the run
  ends, with its page, inside its time.
  """
  if not budget.fits():
    skipped[shape] = budget.why_not()
    return
  with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter()
    common.write_checkpoint(shape, tmp, args.layers, args.dtype)
    written = time.perf_counter() - t0
    for mode in modes:
      if not budget.fits():
        skipped[f"{shape} {mode}"] = budget.why_not()
        continue
      base = {"shape": shape, "mode": mode, "dtype": args.dtype, "hardware": args.hardware,
              "checkpoint_write_s": written}
      print(f"{shape} {mode}: running", flush=True)
      t0 = time.perf_counter()
      try:
        row = common.bench_shape(shape, args, limits, mode=mode, dtype=args.dtype,
                                            hardware_name=args.hardware, checkpoint=tmp)
        row.update(derived(row, limits))
        row["device_peak_mib"] = device_peak_mib()
      except Exception as e:  # noqa: BLE001 - one failing mode must not hide the others
        traceback.print_exc()
        row = {"error": f"{type(e).__name__}: {e}"}
      row.update(base)
      row["mode_wall_s"] = time.perf_counter() - t0
      budget.longest = max(budget.longest, row["mode_wall_s"])
      row["limits"] = limits
      gc.collect()
      yield row


def limits_table(limits: dict, dtype: str, profile: hardware.Hardware) -> list[str]:
  peak = profile.peak(dtype)
  short = results.SHORT_DTYPES.get(dtype, dtype)
  return ["| limit | measured | profile `" + profile.name + "` | measured / profile |",
          "|---|---|---|---|",
          f"| {short} matmul peak, TFLOP/s | {limits['matmul_gflops'] / 1e3:.3g} | "
          f"{peak / 1e12:.3g} | {limits['matmul_gflops'] * 1e9 / peak:.0%} |",
          f"| memory bandwidth, GB/s | {limits['mem_gbps']:.4g} | {profile.hbm_bw / 1e9:.4g} | "
          f"{limits['mem_gbps'] * 1e9 / profile.hbm_bw:.0%} |", ""]


def mib(value: float) -> str:
  return "n/a (no device statistics)" if math.isnan(value) else f"{value:.0f}"


def shape_section(shape: str, rows: list[dict]) -> list[str]:
  done = [r for r in rows if "error" not in r]
  lines = []
  if done:
    r = done[0]
    lines += [f"## {shape} ({r['layers']} layers, {r['params'] / 1e6:.0f}M params; batch "
              f"{r['batch']}, prompt {r['prompt_len']}, new tokens {r['new_tokens']}, "
              f"{r['steps']} timed steps, {r['dtype']})", ""]
  else:
    lines += [f"## {shape}", ""]
  lines += ["| mode | step s | planner s | planner / measured | MFU | decode tokens/s | "
            "roofline tokens/s | of roofline | XLA train MiB | planner MiB | device peak MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['mode']} | failed: {r['error'][:200]} |" + " |" * 9)
      continue
    lines.append(f"| {r['mode']} | {r['step_s']:.3f} | {r['planner_step_s']:.3f} | "
                 f"{r['planner_step_ratio']:.2f} | {r['mfu']:.1%} | "
                 f"{r['decode_tokens_per_s']:.0f} | {r['decode_roofline_tokens_per_s']:.0f} | "
                 f"{r['decode_bandwidth_fraction']:.0%} | {r['xla_train_mib']:.0f} | "
                 f"{r['planner_memory_mib']:.0f} | {mib(r['device_peak_mib'])} |")
  lines += ["", "| mode | stage | s | planner s | GFLOP | TFLOP/s (of peak) | bound s |",
            "|---|---|---|---|---|---|---|"]
  for r in done:
    for s in STAGES:
      lines.append(f"| {r['mode']} | {s} | {r[f'{s}_s']:.3f} | "
                   f"{r.get(f'planner_{s}_s', math.nan):.3f} | {r[f'{s}_flops'] / 1e9:.1f} | "
                   f"{r[f'{s}_gflops'] / 1e3:.3g} ({r[f'{s}_peak_fraction']:.0%}) | "
                   f"{r[f'{s}_bound_s']:.3f} |")
  lines += ["", "Seconds per mode, compile step and XLA's memory analysis included: "
            + ", ".join(f"{r['mode']} {r['mode_wall_s']:.0f}" for r in rows)
            + f"; checkpoint written in {rows[0]['checkpoint_write_s']:.0f} s.", ""]
  return lines


def page_body(rows: list[dict], limits: dict, args, skipped: dict[str, str],
              total_s: float) -> str:
  lines = [__doc__.split("\nUsage:")[0].split("\n", 1)[1].strip(), "",
           *limits_table(limits, args.dtype, hardware.get(args.hardware))]
  for shape in dict.fromkeys(r["shape"] for r in rows):
    lines += shape_section(shape, [r for r in rows if r["shape"] == shape])
  for what, why in skipped.items():
    lines += [f"`{what}` not run: {why}.", ""]
  lines.append(f"The whole run took {total_s:.0f} s (--budget-s {args.budget_s:.0f}).")
  return "\n".join(lines)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split(
      "\nUsage:")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="the tiny CPU size")
  parser.add_argument("--shapes", help=f"default {FULL['shapes']}")
  parser.add_argument("--modes", help="default: every mode that fits the devices")
  parser.add_argument("--layers", type=int, help="override the layer count (0: the shape's)")
  parser.add_argument("--steps", type=int, help="timed steps (after one compile step)")
  parser.add_argument("--batch", type=int)
  parser.add_argument("--prompt-len", type=int)
  parser.add_argument("--new-tokens", type=int)
  # The memory-lean plan (`common.LEAN`): the bf16 shapes on one device, their
  # page comparable from run to run.
  lean = common.LEAN
  parser.add_argument("--logits-chunk", type=int, default=lean["logits_chunk"])
  parser.add_argument("--attention", default=lean["attention"])
  parser.add_argument("--remat", default=lean["remat"], help="the update's remat policy")
  parser.add_argument("--scan-unroll", type=int, default=lean["scan_unroll"],
                      help="layers per layer-scan iteration (0: the library's choice, "
                      "every layer unrolled unless remat is set)")
  parser.add_argument("--dtype", help="default bfloat16 on an accelerator, float32 on a CPU")
  parser.add_argument("--hardware", help="planner profile; default from the device kind")
  parser.add_argument("--matmul-n", type=int, help="side of the peak-measuring matmul")
  parser.add_argument("--stream-mib", type=int, help="MiB summed to measure bandwidth")
  parser.add_argument("--budget-s", type=float, default=420.0,
                      help="seconds the run may take: a mode that would pass it is left out")
  parser.add_argument("--out-dir", default=OUT_DIR)
  results.add_page_flag(parser, "device_check")
  parser.add_argument("--page-dir", default=results.RESULTS_DIR, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  device = jax.devices()[0]
  defaults = dict(FULL, dtype="float32" if device.platform == "cpu" else "bfloat16")
  if args.smoke:
    defaults.update(SMOKE)
  elif args.hardware is None:
    defaults["hardware"] = default_hardware(device)
  for key, value in defaults.items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  start = time.perf_counter()
  os.makedirs(args.out_dir, exist_ok=True)
  fit, skipped = fitting_modes(len(jax.devices()))
  modes = args.modes.split(",") if args.modes else fit
  for mode in modes:
    if mode not in MODES:
      raise SystemExit(f"--modes: unknown mode {mode!r}; choose from {', '.join(MODES)}.")
  skipped = {m: why for m, why in skipped.items() if m not in modes}
  limits = results.machine_limits(args.matmul_n, args.stream_mib, args.dtype)
  print(f"{jax.devices()[0].device_kind}: {args.dtype} matmul peak "
        f"{limits['matmul_gflops']:.1f} GFLOP/s, memory {limits['mem_gbps']:.1f} GB/s; "
        f"modes {', '.join(modes)}; planner profile {args.hardware}", flush=True)
  rows = []
  budget = Budget(args.budget_s, start)
  for shape in args.shapes.split(","):
    for row in check_shape(shape, modes, args, limits, budget, skipped):
      results.record_row(args.out_dir, shape, row)
      rows.append(row)
  total = time.perf_counter() - start
  print(f"total {total:.1f} s", flush=True)
  if args.page:
    path = results.write_page(
        args.page, "PPO steps on one device against its limits and the planner",
        page_body(rows, limits, args, skipped, total), limits, directory=args.page_dir,
        extra={"planner profile": args.hardware, "dtype": args.dtype})
    print(f"wrote {path}")
  return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
