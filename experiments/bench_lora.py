"""Benchmark: PPO with LoRA adapters at a published shape too big to train whole here.

Owns one measurement, per shape of `models/shapes.py` (`--shapes`, default
qwen2.5-0.5b): PPO with a critic and a rule reward (`sequential`, one device, f32, the
memory-lean plan: blockwise attention, full remat in the update, chunked log-probs, a
rolled layer scan), with every parameter trained and with LoRA adapters of `--rank` on
`--targets`:

1. memory: the planner's peak (`planner.memory.plan_memory`) of each, against the
   machine's usable memory;
2. a run: a random-weight checkpoint of the shape, `Models.from_policy(...,
   lora_settings=...)` and `--warmup` + `--steps` PPO steps of the adapted models (the
   first left out: compilation); seconds per stage, the process's peak RSS against the
   planner's memory;
3. weight sync: what pipe mode's train -> generate move costs, the trainer's actor moved
   from device 0 to device 1 (`parallel.reshard`, best of 3): whole, and its adapters
   only (what LoRA's sync moves).

Usage:
  python -m experiments.bench_lora
  python -m experiments.bench_lora --shapes qwen2.5-0.5b --rank 8 --steps 2 --page
  python -m experiments.bench_lora --shapes smollm2-135m --layers 4 --steps 1

Writes <out-dir>/<shape>.jsonl (one row per run; default experiments/out/bench_lora/) and,
with --page, docs/results/lora.md. Timings on a shared machine are noisy: run it alone.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

from pipe_rlhf_jax.host_devices import use_memory_lean_scheduler, use_virtual_cpu_devices

# Two host devices (the sync's source and target); PPO runs on the first.
use_virtual_cpu_devices(2)
use_memory_lean_scheduler()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments import results  # noqa: E402
from experiments.common import (  # noqa: E402
  LEAN,
  MIB,
  STAGES,
  plan_for,
  random_prompts,
  stage_plans,
  write_checkpoint,
)
from pipe_rlhf_jax.config import LoRASettings, PPOSettings  # noqa: E402
from pipe_rlhf_jax.generation import SamplingSettings  # noqa: E402
from pipe_rlhf_jax.models import hf, lora, shapes  # noqa: E402
from pipe_rlhf_jax.parallel import logical  # noqa: E402
from pipe_rlhf_jax.parallel.mesh import MeshShape, make_mesh  # noqa: E402
from pipe_rlhf_jax.parallel.reshard import reshard  # noqa: E402
from pipe_rlhf_jax.planner import hardware, memory, space  # noqa: E402
from pipe_rlhf_jax.stages.common import StageLayout  # noqa: E402
from pipe_rlhf_jax.system import Models, PPOSystem, run  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30

ABOUT = """\
Owns one measurement, per shape of `models/shapes.py` (`--shapes`): PPO with a critic and
a rule reward (`sequential`, one device, f32, the memory-lean plan: blockwise attention,
full remat in the update, chunked log-probs, a rolled layer scan; random weights, no
early EOS, so the work is fixed), with every parameter trained and with LoRA adapters
(`lora.rank`, `lora.targets`):

1. memory: the planner's peak (`planner.memory.plan_memory`) of each against this
   machine's usable memory;
2. a run with adapters: `Models.from_policy(..., lora_settings=...)` and `PPOSystem`,
   `--warmup` steps left out (compilation), then the timed ones: seconds per stage, the
   process's peak RSS (the Python process: runtime, compiler and the model's load
   included) beside the planner's memory;
3. weight sync: the trainer's actor moved from one device to another, as `pipe` mode's
   train -> generate sync moves it (`parallel.reshard`, best of 3): the whole model, and
   its adapters alone, what the sync moves with LoRA."""


def planner_memory(cfg, args) -> dict[str, float]:
  """The planner's peak bytes (one device, sequential, memory-lean) and its terms."""
  plan = plan_for("sequential", stage_plans(LEAN["logits_chunk"], LEAN["attention"],
                                            LEAN["remat"], LEAN["scan_unroll"]))
  work = space.Workload(actor=cfg, batch_size=args.batch, minibatch_size=args.batch,
                        epochs=1, prompt_len=args.prompt_len, gen_len=args.new_tokens,
                        num_devices=1, reward_model=False)
  terms = {s: memory.stage_memory(s, plan.stage(s), dict(data=1, fsdp=1, tensor=1,
                                                           pipeline=1), work).describe()
           for s in STAGES}
  return {"bytes": max(memory.plan_memory(plan, work).values()), "terms": terms}


def sync_seconds(tree, repeats: int = 3) -> tuple[float, float]:
  """(bytes, best seconds) of moving `tree` from device 0's layout to device 1's."""
  target = StageLayout("generate", make_mesh(MeshShape(data=1), jax.devices()[1:2]),
                       logical.DEFAULT_RULES)
  best, moved = float("inf"), 0
  for _ in range(repeats):
    out, stats = reshard(tree, target.param_shardings(tree))
    best, moved = min(best, stats.seconds), stats.bytes
    del out
  return moved, best


def bench(shape: str, args) -> dict:
  overrides = {"num_hidden_layers": args.layers} if args.layers else {}
  base_cfg = shapes.config(shape, dtype="float32", **overrides)
  settings = LoRASettings(rank=args.rank, alpha=args.alpha, targets=args.targets)
  cfg = settings.apply(base_cfg)
  usable = memory.capacity(hardware.get("cpu"), 1)
  whole, adapted = planner_memory(base_cfg, args), planner_memory(cfg, args)
  row = {"shape": shape, "layers": base_cfg.num_layers, "params": base_cfg.num_params(),
         "adapter_params": cfg.num_adapter_params(), "rank": args.rank,
         "alpha": args.alpha, "targets": list(cfg.lora_targets), "batch": args.batch,
         "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
         "steps": args.steps, "usable_mib": usable / MIB,
         "planner_whole_mib": whole["bytes"] / MIB, "planner_lora_mib": adapted["bytes"] / MIB,
         "planner_whole_terms": whole["terms"], "planner_lora_terms": adapted["terms"]}
  with tempfile.TemporaryDirectory() as tmp:
    write_checkpoint(shape, tmp, args.layers)
    policy = hf.from_pretrained(tmp, dtype="float32")
  plan = plan_for("sequential", stage_plans(LEAN["logits_chunk"], LEAN["attention"],
                                            LEAN["remat"], LEAN["scan_unroll"]))
  system = PPOSystem(
      Models.from_policy(policy, lora_settings=settings),
      ppo=PPOSettings(steps=args.steps + args.warmup, batch_size=args.batch,
                      minibatch_size=args.batch, epochs=1, actor_lr=1e-4, critic_lr=1e-4),
      sampling=SamplingSettings(max_new_tokens=args.new_tokens, temperature=1.0,
                                eos_id=None, pad_id=0),
      plan=plan, reward_fn=lambda prompts, completions: [float(len(c)) for c in completions],
      decode=lambda ids: " ".join(str(int(i)) for i in ids), devices=jax.devices()[:1])
  del policy
  t0 = time.perf_counter()
  metrics = run(system, random_prompts(min(base_cfg.vocab_size, 30000), args.batch,
                                       args.prompt_len), args.steps + args.warmup).metrics
  row["wall_s"] = time.perf_counter() - t0
  steady = metrics[args.warmup:]
  for key in ("step",) + STAGES:
    row[f"{key}_s"] = float(np.mean([m[f"time/{key}_s"] for m in steady]))
  row["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  row["finite"] = all(np.isfinite(m["policy_loss"]) and np.isfinite(m["value_loss"])
                      for m in metrics)
  trained = system.trained_actor()
  row["sync_whole_bytes"], row["sync_whole_s"] = sync_seconds(trained)
  row["sync_adapters_bytes"], row["sync_adapters_s"] = sync_seconds(
      lora.split_trainable(trained)[0])
  return row


def page_body(rows) -> str:
  lines = [ABOUT, ""]
  for r in rows:
    lines += [f"## {r['shape']} ({r['layers']} layers, {r['params'] / 1e6:.0f}M params; "
              f"batch {r['batch']}, prompt {r['prompt_len']}, new tokens "
              f"{r['new_tokens']})", "",
              f"Adapters of rank {r['rank']} (alpha {r['alpha']:g}) on "
              f"{', '.join(r['targets'])}: {r['adapter_params'] / 1e6:.2f}M parameters, "
              f"{r['adapter_params'] / r['params']:.2%} of the model's.", "",
              "| | planner peak GiB | usable GiB | fits |", "|---|---|---|---|"]
    for name, key in (("every parameter trained", "whole"), ("LoRA adapters", "lora")):
      need = r[f"planner_{key}_mib"]
      lines.append(f"| {name} | {need / 1024:.1f} | {r['usable_mib'] / 1024:.1f} | "
                   f"{'yes' if need <= r['usable_mib'] else 'no'} |")
    lines += ["", "The planner's terms with adapters:", ""]
    lines += [f"- {s}: {r['planner_lora_terms'][s]}" for s in STAGES]
    lines += ["", f"Run with adapters ({r['steps']} timed steps after the compile step): "
              f"{r['step_s']:.1f} s per step (generate {r['generate_s']:.1f}, infer "
              f"{r['infer_s']:.1f}, train {r['train_s']:.1f}); losses finite: "
              f"{'yes' if r['finite'] else 'no'}; peak RSS {r['peak_rss_mib'] / 1024:.1f} "
              f"GiB against the planner's {r['planner_lora_mib'] / 1024:.1f} GiB.", "",
              "| weight sync, device 0 -> device 1 | MiB | s |", "|---|---|---|",
              f"| the whole actor | {r['sync_whole_bytes'] / MIB:.1f} | "
              f"{r['sync_whole_s']:.3f} |",
              f"| its adapters (what LoRA's sync moves) | {r['sync_adapters_bytes'] / MIB:.1f}"
              f" | {r['sync_adapters_s']:.4f} |", ""]
  return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split(
      "\nUsage:")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", default="qwen2.5-0.5b",
                      help="published shapes of models/shapes.py, comma-separated")
  parser.add_argument("--layers", type=int, default=0, help="override the layer count")
  parser.add_argument("--rank", type=int, default=8)
  parser.add_argument("--alpha", type=float, default=16.0)
  parser.add_argument("--targets", default="all")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt-len", type=int, default=64)
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--steps", type=int, default=2, help="timed steps")
  parser.add_argument("--warmup", type=int, default=1, help="steps left out (compilation)")
  parser.add_argument("--out-dir", default=os.path.join(_ROOT, "experiments", "out",
                                                        "bench_lora"))
  results.add_page_flag(parser, "lora")
  parser.add_argument("--page-dir", default=results.RESULTS_DIR, help=argparse.SUPPRESS)
  return parser.parse_args(argv)


def main(argv=None) -> None:
  args = parse_args(argv)
  os.makedirs(args.out_dir, exist_ok=True)
  limits = results.machine_limits()
  rows = []
  for shape in args.shapes.split(","):
    row = bench(shape, args)
    rows.append(row)
    results.record_row(args.out_dir, shape, row)
  if args.page:
    path = results.write_page(args.page, "PPO with LoRA adapters at a published shape",
                              page_body(rows), limits, directory=args.page_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
