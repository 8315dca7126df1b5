"""Benchmark: seconds per PPO step and per stage, at toy sizes or at published model shapes.

Owns one measurement, `PPOSystem` (`sequential`, one device, f32) running PPO steps of a
fixed amount of work against the machine's limits, at two sets of sizes, each with its
page:

- `--sizes` (the default: 1,2,3 of `experiments.shapes.SIZES`), `SIZES_ABOUT`; its table
  goes to docs/results/ppo_step.md;
- `--shapes` (published shapes of `models/shapes.py`, random weights), `SHAPES_ABOUT`,
  with the planner's prediction beside each measurement; docs/results/real_shapes.md.

`--steps` PPO steps are timed after `--warmup` steps (compilation) left out: by default 8
after 2 at toy sizes, 2 after 1 at published shapes. The flags that size and plan a
published shape (`--layers`, `--batch`, `--attention`, ...) are refused with `--sizes`,
whose sizes fix them.

Usage:
  python -m experiments.bench_ppo_step
  python -m experiments.bench_ppo_step --sizes 2 --steps 10 --scan-unroll 1
  python -m experiments.bench_ppo_step --shapes smollm2-135m --steps 2
  python -m experiments.bench_ppo_step --shapes smollm2-135m --layers 4 --steps 1 --page
  python -m experiments.bench_ppo_step --shapes smollm2-135m,qwen2.5-0.5b,qwen3-0.6b \
      --memory-only qwen2.5-0.5b,qwen3-0.6b --page
  python -m experiments.bench_ppo_step --shapes smollm2-135m --attention blockwise \
      --remat full --logits-chunk 32 --scan-unroll 1

Writes, to --out-dir, ppo_step.json and ppo_step.md at toy sizes (default
experiments/out/bench_ppo_step/) or <shape>.jsonl, one row per shape and run, at published
shapes (default experiments/out/real_shapes/); with --page, the page of its set of sizes.
Timings on a shared machine are noisy: run it alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from pipe_rlhf_jax.host_devices import use_memory_lean_scheduler

# Before jax starts its backend; the planner's calibration and the main job use it too.
use_memory_lean_scheduler()

import jax  # noqa: E402

from experiments import results  # noqa: E402
from experiments.common import (  # noqa: E402
  DEFAULTS,
  LEAN,
  MIB,
  STAGES,
  bench_shape,
  bench_size,
  plan_for,
  stage_plans,
  xla_peaks,
)
from pipe_rlhf_jax.planner import hardware, memory, space  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What each page says it measures (the page's first paragraphs).
SIZES_ABOUT = """\
Owns one measurement: `PPOSystem` (library API, `sequential` mode, one device, f32) at
three model sizes, each running `--warmup` + `--steps` PPO steps of: generate (batch x gen
tokens, no early EOS, so the work is fixed), inference (reference log-probs + critic
values), and one actor and one critic update on the whole batch (epochs=1, one
minibatch), with a host rule reward. The first `--warmup` steps (compilation) are left
out.

For each stage it reports the achieved FLOP/s (analytic counts, `models/flops.py`) next to
the f32 matmul peak measured in the same process (a jitted 2048x2048 matmul, best of 5),
and for decoding the bytes/s it must read (weights + KV cache per step) next to the
measured memory bandwidth (`results.machine_limits`: the faster of a sum and a
matrix-vector product over 256 MiB, best of 5). The update is also
set against the rate of its own GEMM shapes run alone (`common.gemm_shapes`: every projection
and head matmul of the forward and backward, one jitted program): small projections
([batch x length, d] x [d, f] with d = 64..512) do not reach the 2048^2 peak even alone,
so this says how much of the gap is the shapes and how much the rest of the update.

`--scan-unroll` sets every stage's `scan_unroll` (0, the default: the model's layer
count, i.e. the layer scan unrolled; 1: a loop over the stacked layers)."""

SHAPES_ABOUT = """\
Owns one measurement: for each shape of `models/shapes.py` (`--shapes`), a random-weight
Hugging Face directory is written (`models.random_checkpoint`), loaded through
`models.hf.from_pretrained`, and `PPOSystem` runs `--steps` PPO steps (`sequential`, one
device, f32; by default each stage's plan is `StagePlan()`'s, what a library user gets:
dense attention within a block, no remat, log-probs all at once, every layer unrolled;
`--attention blockwise --remat full --logits-chunk 32 --scan-unroll 1` is the
memory-lean plan that shapes too big for those defaults need; no early EOS, so the work is
fixed). The first `--warmup` steps (by default one, the compile step) are left out. Shapes
too big for the machine (`--memory-only`) are sized, not run.

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
stage timings, so the check stays held out)."""

# Per set of sizes: the defaults of the flags both take, and the page `--page` alone writes.
MODES = {
    "sizes": dict(steps=8, warmup=2, page="ppo_step",
                  out_dir=os.path.join(_ROOT, "experiments", "out", "bench_ppo_step")),
    "shapes": dict(steps=2, warmup=1, page="real_shapes",
                   out_dir=os.path.join(_ROOT, "experiments", "out", "real_shapes")),
}
# The flags of `--shapes` alone, with their defaults (the plan's: the library's own,
# `StagePlan()`, so that the benchmark measures what a user gets; `LEAN` is the memory-lean
# alternative).
SHAPE_DEFAULTS = dict(layers=0, batch=8, prompt_len=64, new_tokens=64,
                      logits_chunk=DEFAULTS.logits_chunk, attention=DEFAULTS.attention,
                      remat=DEFAULTS.remat, untied=False, memory_only="", calibration="")
# `--page` alone, before it is resolved to the page of the set of sizes run.
_OWN_PAGE = "<its own page>"


def run_sizes(args, limits) -> None:
  """The toy sizes: one row per size, ppo_step.json/.md in --out-dir, and the page."""
  rows = []
  for size in [int(s) for s in args.sizes.split(",")]:
    row = bench_size(size, args.warmup + args.steps, args.warmup, args.scan_unroll)
    rows.append(row)
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                      for k, v in row.items()}), flush=True)
  command = results.command_line()
  with open(os.path.join(args.out_dir, "ppo_step.json"), "w", encoding="utf-8") as f:
    json.dump({"command": command, "backend": jax.default_backend(), "limits": limits,
               "rows": rows}, f, indent=2)
  lines = [f"`{command}` ({jax.default_backend()}, 1 device, f32; matmul peak "
           f"{limits['matmul_gflops']:.0f} GFLOP/s, memory {limits['mem_gbps']:.1f} GB/s)",
           "", "| dims (layers, d, heads/kv, ffn, vocab; batch, prompt, gen) | s/step | "
           "generate / infer / train / other s | train GFLOP/s (% of peak) | "
           "its GEMM shapes alone: GFLOP/s (train as %) | infer GFLOP/s | decode GB/s |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    d = r["dims"]
    lines.append(
        f"| {d[0]}, {d[1]}, {d[2]}/{d[3]}, {d[4]}, {d[5]}; {d[6]}, {d[7]}, {d[8]} | "
        f"{r['s_per_step']:.3f} | {r['generate_s']:.3f} / {r['infer_s']:.3f} / "
        f"{r['train_s']:.3f} / {r['other_s']:.3f} | {r['train_gflops']:.1f} "
        f"({100 * r['train_gflops'] / limits['matmul_gflops']:.0f}%) | "
        f"{r['train_shapes_gflops']:.1f} "
        f"({100 * r['train_gflops'] / r['train_shapes_gflops']:.0f}%) | "
        f"{r['infer_gflops']:.1f} | {r['decode_gbps']:.2f} |")
  with open(os.path.join(args.out_dir, "ppo_step.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  if args.page:
    body = [SIZES_ABOUT, "",
            f"Mean over steps {args.warmup + 1}..{args.warmup + args.steps}; `--scan-unroll "
            f"{args.scan_unroll}`.", ""] + lines[2:]
    path = results.write_page(args.page, "Seconds per PPO step at toy sizes",
                              "\n".join(body), limits, directory=args.page_dir)
    print(f"wrote {path}")


def run_shapes(args, limits) -> None:
  """The published shapes: one row per shape appended to <shape>.jsonl, and the page."""
  rows = []
  for shape in args.shapes.split(","):
    row = (memory_row(shape, args) if shape in args.memory_only.split(",")
           else bench_shape(shape, args, limits))
    row["limits"] = limits
    rows.append(row)
    results.record_row(args.out_dir, shape, row)
  if args.page:
    path = results.write_page(args.page, "PPO steps at real model shapes",
                              shapes_page_body(rows), limits, directory=args.page_dir)
    print(f"wrote {path}")


def memory_row(shape: str, args) -> dict:
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
  plan = plan_for("sequential", plans)
  work = space.Workload(actor=cfg, batch_size=batch, minibatch_size=batch, epochs=1,
                        prompt_len=prompt, gen_len=gen, num_devices=1, reward_model=False)
  need = max(memory.plan_memory(plan, work).values())
  usable = memory.capacity(hardware.get("cpu"), 1)
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  row = {"shape": shape, "layers": cfg.num_layers, "params": cfg.num_params(),
         "batch": batch, "prompt_len": prompt, "new_tokens": gen, "memory_only": True,
         "planner_memory_mib": need / MIB, "usable_mib": usable / MIB,
         "host_ram_mib": host / MIB, "fits": bool(need <= min(usable, host)),
         "planner_terms": {s: memory.stage_memory(s, plan.stage(s),
                                                  dict(data=1, fsdp=1, tensor=1, pipeline=1),
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


def shapes_page_body(rows) -> str:
  lines = [SHAPES_ABOUT, ""]
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


def parse_args(argv=None) -> argparse.Namespace:
  """The flags, with the defaults of the set of sizes asked for filled in (`MODES`,
  `SHAPE_DEFAULTS`); `args.mode` names that set."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split(
      "\nUsage:")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
  which = parser.add_mutually_exclusive_group()
  which.add_argument("--sizes", default="",
                     help="toy sizes of experiments.shapes.SIZES (the default: 1,2,3)")
  which.add_argument("--shapes", default="",
                     help="published shapes of models/shapes.py, e.g. smollm2-135m")
  parser.add_argument("--steps", type=int, help="timed steps (default: 8 at toy sizes, 2 at "
                      "published shapes)")
  parser.add_argument("--warmup", type=int, help="steps (compilation) left out before the "
                      "timed ones (default: 2 at toy sizes, 1 at published shapes)")
  parser.add_argument("--scan-unroll", type=int, default=DEFAULTS.scan_unroll,
                      help="layers per layer-scan iteration (0: every layer unrolled, at "
                      "published shapes unless remat is set; memory-lean: "
                      f"{LEAN['scan_unroll']}, a loop)")
  shaped = parser.add_argument_group("published shapes only (--shapes)")
  shaped.add_argument("--layers", type=int, help="override the layer count")
  shaped.add_argument("--batch", type=int, help=f"default {SHAPE_DEFAULTS['batch']}")
  shaped.add_argument("--prompt-len", type=int,
                      help=f"default {SHAPE_DEFAULTS['prompt_len']}")
  shaped.add_argument("--new-tokens", type=int,
                      help=f"default {SHAPE_DEFAULTS['new_tokens']}")
  shaped.add_argument("--logits-chunk", type=int,
                      help=f"0 (default): all at once; memory-lean: {LEAN['logits_chunk']}")
  shaped.add_argument("--attention", help=f"every stage's attention (default "
                      f"{DEFAULTS.attention}); memory-lean: {LEAN['attention']}")
  shaped.add_argument("--remat", help=f"the update's remat policy (default {DEFAULTS.remat}); "
                      f"memory-lean: {LEAN['remat']}")
  shaped.add_argument("--untied", action="store_true", default=None,
                      help="an LM head of its own, not tied to the embedding")
  shaped.add_argument("--memory-only", help="shapes (of --shapes) to size without running: "
                      "the planner's memory and XLA's compiled peaks")
  shaped.add_argument("--calibration",
                      help="a planner.calibrate JSON file for the planner's prediction")
  parser.add_argument("--out-dir", help="default: experiments/out/bench_ppo_step at toy "
                      "sizes, experiments/out/real_shapes at published shapes")
  results.add_page_flag(parser, _OWN_PAGE, "ppo_step with --sizes, real_shapes with --shapes")
  parser.add_argument("--page-dir", default=results.RESULTS_DIR, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  args.mode = "shapes" if args.shapes else "sizes"
  if args.mode == "sizes":
    given = ["--" + k.replace("_", "-") for k in SHAPE_DEFAULTS if getattr(args, k) is not None]
    if given:
      parser.error(f"{', '.join(given)}: for published shapes (--shapes) only; the toy "
                   "sizes fix their model, batch and lengths")
    args.sizes = args.sizes or "1,2,3"
  for key, value in {**SHAPE_DEFAULTS, **MODES[args.mode]}.items():
    # The page is written only when asked (--page): its name is not a default to fill.
    if key != "page" and getattr(args, key) is None:
      setattr(args, key, value)
  if args.page == _OWN_PAGE:
    args.page = MODES[args.mode]["page"]
  return args


def main(argv=None) -> None:
  args = parse_args(argv)
  os.makedirs(args.out_dir, exist_ok=True)
  limits = results.machine_limits()
  print(f"f32 matmul peak {limits['matmul_gflops']:.1f} GFLOP/s, memory "
        f"{limits['mem_gbps']:.1f} GB/s", flush=True)
  (run_shapes if args.mode == "shapes" else run_sizes)(args, limits)


if __name__ == "__main__":
  main()
