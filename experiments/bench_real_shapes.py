"""Benchmark: PPO steps at published model shapes, against the machine's limits and the planner.

Owns one measurement: for each shape of `models/shapes.py` (`--shapes`), a random-weight
Hugging Face directory is written (`models.random_checkpoint`), loaded through
`models.hf.from_pretrained`, and `PPOSystem` runs `--steps` PPO steps (`sequential`, one
device, f32; by default each stage's plan is `StagePlan()`'s, what a library user gets:
dense attention within a block, no remat, log-probs all at once, every layer unrolled;
`--attention blockwise --remat full --logits-chunk 32 --scan-unroll 1` is the
memory-lean plan that shapes too big for those defaults need; no early EOS, so the work is
fixed). The first step compiles and is left out. Shapes too big for the machine
(`--memory-only`) are sized, not run.

Per stage (generate, infer, train) it reports seconds, FLOPs (`models/flops.py`) and the
achieved FLOP/s against the f32 matmul peak measured in the same process; for decoding the
bytes per token step (weights + KV cache) against the measured memory bandwidth (the
faster of a sum and a matrix-vector product over 256 MiB, `results.machine_limits`).
Beside each, what the stage's own matmuls reach run alone in one program: the update's
GEMM shapes against the matmul peak, the decode step's [batch, K] x [K, N] products
against the bandwidth (the backend's ceiling at that row count); and one model's optimizer
step beside AdamW alone (`common.optimizer_seconds`). The step's bound is the
sum over stages of max(FLOPs / peak, bytes / bandwidth). Memory: XLA's
`memory_analysis()` of the actor's completion log-probs (forward: infer; value_and_grad:
train) and of one cached decode step, the process peak RSS, and the planner's memory model
(`planner.memory.plan_memory`). The planner's predicted step time
(`planner.search.price`, analytic cpu profile) is set beside the measured one twice: with
the profile's assumed efficiencies, and with efficiencies probed in the same run on the
stage's own matmul shapes and optimizer step (`common.probed_machine`; microbenchmarks, not the
stage timings, so the check stays held out).

Usage:
  python -m experiments.bench_real_shapes --shapes smollm2-135m --steps 2
  python -m experiments.bench_real_shapes --shapes smollm2-135m --layers 4 --steps 1 --page
  python -m experiments.bench_real_shapes --shapes smollm2-135m,qwen2.5-0.5b,qwen3-0.6b \
      --memory-only qwen2.5-0.5b,qwen3-0.6b --page
  python -m experiments.bench_real_shapes --shapes smollm2-135m --attention blockwise \
      --remat full --logits-chunk 32 --scan-unroll 1

Writes experiments/out/real_shapes/<shape>.jsonl (one row per shape and run) and, with
--page, docs/results/real_shapes.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from pipe_rlhf_jax.host_devices import use_memory_lean_scheduler

# Before jax starts its backend; the planner's calibration and the main job use it too.
use_memory_lean_scheduler()

from experiments import results
from experiments.common import (
  DEFAULTS,
  LEAN,
  MIB,
  STAGES,
  bench_shape,
  runtime_for,
  stage_plans,
  xla_peaks,
)
from pipe_rlhf_jax.planner import hardware, memory, space

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(_ROOT, "experiments", "out", "real_shapes")


def memory_row(shape: str, args, limits) -> dict:
  """What a shape would need, without running it: the planner's peak, the machine's usable
  memory, and XLA's peaks of the actor's stage functions, compiled on abstract parameters
  (`--memory-only`, for shapes that do not fit). Sized with blockwise attention, full
  remat and a rolled layer scan (and `--logits-chunk`), whatever the other flags: near the
  least it needs."""
  from pipe_rlhf_jax.models import shapes
  overrides = {"num_hidden_layers": args.layers} if args.layers else {}
  cfg = shapes.config(shape, dtype="float32", **overrides)
  batch, prompt, gen = args.batch, args.prompt_len, args.new_tokens
  plans = stage_plans(args.logits_chunk, LEAN["attention"], LEAN["remat"],
                      LEAN["scan_unroll"])
  runtime = runtime_for("sequential", plans)
  work = space.Workload(actor=cfg, batch_size=batch, minibatch_size=batch, epochs=1,
                        prompt_len=prompt, gen_len=gen, num_devices=1, reward_model=False)
  need = max(memory.plan_memory(runtime, work).values())
  usable = memory.capacity(hardware.get("cpu"), 1)
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  row = {"shape": shape, "layers": cfg.num_layers, "params": cfg.num_params(),
         "batch": batch, "prompt_len": prompt, "new_tokens": gen, "memory_only": True,
         "planner_memory_mib": need / MIB, "usable_mib": usable / MIB,
         "host_ram_mib": host / MIB, "fits": bool(need <= min(usable, host)),
         "planner_terms": {s: memory.stage_memory(s, runtime.stage(s),
                                                  dict(data=1, fsdp=1, tensor=1, pipe=1),
                                                  work).describe() for s in STAGES}}
  row.update({f"xla_{s}_mib": v for s, v in xla_peaks(cfg, batch, prompt, gen, plans).items()})
  return row


GOALS = (
    ("step within 2x of bound", "measured_over_bound", lambda v: v <= 2.0, "{:.2f}x"),
    ("decode >= 50% of bandwidth bound", "decode_bandwidth_fraction", lambda v: v >= 0.5,
     "{:.0%}"),
    ("update >= 50% of matmul peak", "train_peak_fraction", lambda v: v >= 0.5, "{:.0%}"),
    ("planner step-time error <= 20% (assumed efficiencies)", "planner_step_error",
     lambda v: v <= 0.2, "{:.0%}"),
    ("planner step-time error <= 20% (probed efficiencies, no non-matmul term)",
     "planner_probed_noterm_step_error", lambda v: v <= 0.2, "{:.0%}"),
    ("planner step-time error <= 20% (probed efficiencies)", "planner_probed_step_error",
     lambda v: v <= 0.2, "{:.0%}"),
    ("memory model within 25% (of peak RSS)", "memory_model_error", lambda v: v <= 0.25,
     "{:.0%}"),
)


def page_body(rows) -> str:
  lines = [__doc__.split("\nUsage:")[0].split("\n", 1)[1].strip(), ""]
  for r in rows:
    if r.get("memory_only"):
      lines += [f"## {r['shape']} ({r['layers']} layers, {r['params'] / 1e6:.0f}M params; "
                f"batch {r['batch']}, prompt {r['prompt_len']}, new tokens "
                f"{r['new_tokens']}): memory only, blockwise attention and full remat", "",
                f"Not run: the planner's memory model puts the step's peak at "
                f"{r['planner_memory_mib'] / 1024:.1f} GiB, against "
                f"{r['usable_mib'] / 1024:.1f} GiB usable of this machine's "
                f"{r['host_ram_mib'] / 1024:.1f} GiB of RAM"
                + (" (it fits)." if r["fits"] else ": it does not fit.")
                + " Its terms per stage (actor, critic and reference state, Adam moments, "
                  "activations):", ""]
      lines += [f"- {s}: {r['planner_terms'][s]}" for s in STAGES]
      lines += ["", "XLA's peak of the actor's stage functions alone (compiled on abstract "
                    "parameters): " + ", ".join(f"{s} {r[f'xla_{s}_mib']:.0f} MiB"
                                                 for s in STAGES) + ".", ""]
      continue
    lines += [f"## {r['shape']} ({r['layers']} layers, {r['params'] / 1e6:.0f}M params; "
              f"batch {r['batch']}, prompt {r['prompt_len']}, new tokens {r['new_tokens']}, "
              f"{r['steps']} timed steps)", "",
              "| stage | s | planner s | planner s, probed | GFLOP | GFLOP/s (% of peak) | "
              "bound s | XLA peak MiB |", "|---|---|---|---|---|---|---|---|"]
    for s in STAGES:
      lines.append(f"| {s} | {r[f'{s}_s']:.3f} | {r.get(f'planner_{s}_s', math.nan):.3f} | "
                   f"{r.get(f'planner_probed_{s}_s', math.nan):.3f} | "
                   f"{r[f'{s}_flops'] / 1e9:.1f} | {r[f'{s}_gflops']:.1f} "
                   f"({r[f'{s}_peak_fraction']:.0%}) | {r[f'{s}_bound_s']:.3f} | "
                   f"{r[f'xla_{s}_mib']:.0f} |")
    lines += [f"| step | {r['step_s']:.3f} | {r['planner_step_s']:.3f} | "
              f"{r.get('planner_probed_step_s', math.nan):.3f} | | | "
              f"{r['bound_s']:.3f} | |", "",
              f"Decode: {r['decode_bytes_per_token_step'] / MIB:.1f} MiB read per token step, "
              f"{r['decode_gbps']:.2f} GB/s ({r['decode_bandwidth_fraction']:.0%} of the "
              f"measured bandwidth); its matmuls alone (every layer's projections and the "
              f"head at {r['batch']} rows, one program) read their weights at "
              f"{r['decode_shapes_gbps']:.2f} GB/s "
              f"({r['decode_shapes_gbps'] / r['limits']['mem_gbps']:.0%} of the bandwidth): "
              f"the decode reaches {r['decode_gbps'] / r['decode_shapes_gbps']:.0%} of that. "
              f"Memory: peak RSS {r['peak_rss_mib']:.0f} MiB, planner "
              f"{r['planner_memory_mib']:.0f} MiB. The update's GEMM shapes alone run at "
              f"{r['train_shapes_gflops']:.1f} GFLOP/s "
              f"({r['train_shapes_gflops'] * 1e9 / (r['limits']['matmul_gflops'] * 1e9):.0%}"
              f" of the peak); the update reaches "
              f"{r['train_gflops'] / r['train_shapes_gflops']:.0%} of that. One model's "
              f"optimizer step (global norm, finiteness test, clipping, AdamW; state "
              f"donated) takes {r['optimizer_s']:.3f} s, AdamW alone "
              f"{r['adamw_s']:.3f} s.", "",
              "Plan: " + "; ".join(
                  f"{s} attention={p['attention']}, remat={p['remat']}, "
                  f"logits_chunk={p['logits_chunk']}, scan_unroll={p['scan_unroll']}"
                  for s, p in r.get("plans", {}).items())
              + f". Planner efficiencies: {r.get('planner_efficiency', 'n/a')}; probed ("
              + ", ".join(f"{k} {v:.2f}" for k, v in r.get(
                  "planner_probed_efficiency", {}).items())
              + "): the forward's and the update's matmul shapes against the matmul peak, "
                "the decode step's matmuls against the bandwidth, one model's optimizer "
                "step against the bandwidth (`probed_machine`). Both include the non-matmul "
                "term (passes per activation element: "
              + ", ".join(f"{k} {v:.1f}" for k, v in r.get("planner_elementwise", {}).items())
              + "; fitted across toy sizes by `fit_elementwise.py`, this shape held out); "
                "with it off, the probed prediction is "
              + f"{r.get('planner_probed_noterm_step_s', math.nan):.3f} s.", "",
              "| goal | measured | |", "|---|---|---|"]
    for name, key, ok, fmt in GOALS:
      if key not in r:  # a row recorded before the goal existed
        continue
      lines.append(f"| {name} | {fmt.format(r[key])} | {'met' if ok(r[key]) else 'not met'} |")
    lines.append("")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split(
      "\nUsage:")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", default="smollm2-135m")
  parser.add_argument("--layers", type=int, default=0, help="override the layer count")
  parser.add_argument("--steps", type=int, default=2, help="timed steps (after one compile step)")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt-len", type=int, default=64)
  parser.add_argument("--new-tokens", type=int, default=64)
  # Defaults: the library's (`StagePlan()`), so that the benchmark measures what a user
  # gets; `LEAN` is the memory-lean alternative.
  parser.add_argument("--logits-chunk", type=int, default=DEFAULTS.logits_chunk,
                      help=f"0: all at once; memory-lean: {LEAN['logits_chunk']}")
  parser.add_argument("--attention", default=DEFAULTS.attention,
                      help=f"every stage's attention; memory-lean: {LEAN['attention']}")
  parser.add_argument("--remat", default=DEFAULTS.remat,
                      help=f"the update's remat policy; memory-lean: {LEAN['remat']}")
  parser.add_argument("--scan-unroll", type=int, default=DEFAULTS.scan_unroll,
                      help="layers per layer-scan iteration (0: the library's choice, "
                      "every layer unrolled unless remat is set; memory-lean: "
                      f"{LEAN['scan_unroll']}, a loop)")
  parser.add_argument("--untied", action="store_true",
                      help="an LM head of its own, not tied to the embedding")
  parser.add_argument("--memory-only", default="", help="shapes (of --shapes) to size "
                      "without running: the planner's memory and XLA's compiled peaks")
  parser.add_argument("--calibration", default="",
                      help="a planner.calibrate JSON file for the planner's prediction")
  parser.add_argument("--out-dir", default=OUT_DIR)
  results.add_page_flag(parser, "real_shapes")
  parser.add_argument("--page-dir", default=results.RESULTS_DIR, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  os.makedirs(args.out_dir, exist_ok=True)
  limits = results.machine_limits()
  print(f"matmul peak {limits['matmul_gflops']:.1f} GFLOP/s, memory "
        f"{limits['mem_gbps']:.1f} GB/s", flush=True)
  rows = []
  for shape in args.shapes.split(","):
    row = (memory_row(shape, args, limits) if shape in args.memory_only.split(",")
           else bench_shape(shape, args, limits))
    row["limits"] = limits
    rows.append(row)
    with open(os.path.join(args.out_dir, f"{shape}.jsonl"), "a", encoding="utf-8") as f:
      f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
  if args.page:
    path = results.write_page(args.page, "PPO steps at real model shapes",
                              page_body(rows), limits, directory=args.page_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
