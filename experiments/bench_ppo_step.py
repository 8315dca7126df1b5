"""Benchmark: seconds per PPO step and per stage, against the machine's own limits.

Owns one measurement (`common.bench_size`): `PPOSystem` (library API, `sequential` mode,
one device, f32) at three model sizes, each running `--steps` PPO steps of: generate
(batch x gen tokens, no early EOS, so the work is fixed), inference (reference log-probs +
critic values), and one actor and one critic update on the whole batch (epochs=1, one
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
count, i.e. the layer scan unrolled; 1: a loop over the stacked layers).

Usage:
  python -m experiments.bench_ppo_step
  python -m experiments.bench_ppo_step --sizes 2 --steps 12 --scan-unroll 1

Writes ppo_step.json and ppo_step.md to --out-dir (default experiments/out/bench_ppo_step/)
and, with --page, docs/results/ppo_step.md.
Timings on a shared machine are noisy: run it alone.
"""

from __future__ import annotations

import argparse
import json
import os

import jax

from experiments import results
from experiments.common import bench_size

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes", default="1,2,3")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--scan-unroll", type=int, default=0,
                      help="layers per iteration of the layer scan (0: all of them)")
  parser.add_argument("--out-dir", default=os.path.join(_ROOT, "experiments", "out",
                                                        "bench_ppo_step"))
  results.add_page_flag(parser, "ppo_step")
  args = parser.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  limits = results.machine_limits()
  print(f"f32 matmul peak {limits['matmul_gflops']:.1f} GFLOP/s, memory "
        f"{limits['mem_gbps']:.1f} GB/s", flush=True)
  rows = []
  for size in [int(s) for s in args.sizes.split(",")]:
    row = bench_size(size, args.steps, args.warmup, args.scan_unroll)
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
    body = [__doc__.split("\nUsage:")[0].split("\n", 1)[1].strip(), "",
            f"Mean over steps {args.warmup + 1}..{args.steps}; `--scan-unroll "
            f"{args.scan_unroll}`.", ""] + lines[2:]
    path = results.write_page(args.page, "Seconds per PPO step at toy sizes",
                              "\n".join(body), limits)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
