"""Benchmark: seconds per PPO step and per stage, against the machine's own limits.

Owns one measurement: `PPOSystem` (library API, `sequential` mode, one device, f32) at
three model sizes, each running `--steps` PPO steps of: generate (batch x gen tokens, no
early EOS, so the work is fixed), inference (reference log-probs + critic values), and one
actor and one critic update on the whole batch (epochs=1, one minibatch), with a host rule
reward. The first `--warmup` steps (compilation) are left out.

For each stage it reports the achieved FLOP/s (analytic counts, `models/flops.py`) next to
the f32 matmul peak measured in the same process (a jitted 2048x2048 matmul, best of 5),
and for decoding the bytes/s it must read (weights + KV cache per step) next to the
measured memory bandwidth (`results.machine_limits`: the faster of a sum and a
matrix-vector product over 256 MiB, best of 5). The update is also
set against the rate of its own GEMM shapes run alone (`gemm_shapes`: every projection
and head matmul of the forward and backward, one jitted program): small projections
([batch x length, d] x [d, f] with d = 64..512) do not reach the 2048^2 peak even alone,
so this says how much of the gap is the shapes and how much the rest of the update.

`--scan-unroll` sets every stage's `scan_unroll` (0, the default: the model's layer
count, i.e. the layer scan unrolled; 1: a loop over the stacked layers).

Usage:
  python experiments/bench_ppo_step.py
  python experiments/bench_ppo_step.py --sizes 2 --steps 12 --scan-unroll 1

Writes ppo_step.json and ppo_step.md to --out-dir (default experiments/out/bench_ppo_step/)
and, with --page, docs/results/ppo_step.md.
Timings on a shared machine are noisy: run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import results  # noqa: E402
from pipe_rlhf_jax.generation import SamplingParams  # noqa: E402
from pipe_rlhf_jax.models import flops, init_model, tiny_config  # noqa: E402
from pipe_rlhf_jax.system import (  # noqa: E402
  MeshSpec,
  Models,
  Plan,
  PPOConfig,
  PPOSystem,
  StagePlan,
  run,
)

# (layers, embed, heads, kv_heads, mlp, vocab; batch, prompt, gen): the first two are also
# the sizes of the comparison with a peer library (bench_peer_tunix.py), the third a
# larger one.
SIZES = {
    1: (2, 64, 4, 2, 128, 256, 8, 16, 16),
    2: (4, 256, 8, 4, 512, 512, 16, 32, 32),
    3: (6, 512, 8, 4, 1024, 1024, 16, 64, 64),
    # Wider and deeper, SmolLM2-135M's batch and lengths: the largest size the planner's
    # non-matmul term is fitted on (`fit_elementwise.py`), in about 10 s a step.
    4: (8, 768, 12, 4, 2048, 8192, 8, 64, 64),
}


def gemm_shapes(cfg, tokens: int, head_tokens: int) -> list[tuple[int, int, int]]:
  """The (M, K, N) matmuls of one forward+backward over `tokens` tokens: per layer the
  q/k/v/o and gate/up/down projections (each also as its input- and weight-gradient
  matmul), and the head over `head_tokens` positions. Attention's batched score and value
  products are left out: they are not [M, K] x [K, N] GEMMs of the 2048^2 peak's kind."""
  d, heads, kv, hd, f = (cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         cfg.mlp_dim)
  layer = [(tokens, d, heads * hd), (tokens, d, kv * hd), (tokens, d, kv * hd),
           (tokens, heads * hd, d), (tokens, d, f), (tokens, d, f), (tokens, f, d)]
  forward = layer * cfg.num_layers + [(head_tokens, d, cfg.vocab_size)]
  # Backward of y[M, N] = x[M, K] w[K, N]: dx = dy w^T (M, N, K) and dw = x^T dy (K, M, N).
  return forward + [(m, n, k) for m, k, n in forward] + [(k, m, n) for m, k, n in forward]


def decode_shapes(cfg, batch: int) -> list[tuple[int, int, int]]:
  """The (M, K, N) matmuls of one decode step of `batch` rows: every layer's projections
  and the LM head, each on one token per row (M = batch)."""
  return [(batch, k, n) for _, k, n in gemm_shapes(cfg, 1, 1)[:7 * cfg.num_layers + 1]]


def shape_seconds(shapes: list[tuple[int, int, int]], dtype: str = "float32") -> float:
  """Seconds of exactly these matmuls in `dtype`, alone in one jitted program (best of
  5)."""
  operands = [(jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)) for m, k, n in shapes]
  products = jax.jit(lambda ops: [a @ b for a, b in ops])
  return results.best_of(lambda: jax.block_until_ready(products(operands)))


def shape_rate(shapes: list[tuple[int, int, int]], dtype: str = "float32") -> float:
  """GFLOP/s of exactly these matmuls alone (`shape_seconds`): what the update could
  reach if it did nothing but its GEMMs."""
  return sum(2 * m * k * n for m, k, n in shapes) / shape_seconds(shapes, dtype) / 1e9


def weight_rate(shapes: list[tuple[int, int, int]], dtype: str = "float32") -> float:
  """GB/s of the weights ([K, N] in `dtype`) these matmuls read, run alone (`shape_seconds`):
  how fast the backend streams a decode step's weights at its row count, the ceiling of
  a decode that did nothing else."""
  size = jnp.dtype(dtype).itemsize
  return sum(size * k * n for _, k, n in shapes) / shape_seconds(shapes, dtype) / 1e9


def optimizer_seconds(cfg, repeats: int = 5) -> dict[str, float]:
  """Seconds of one optimizer step on `cfg`'s parameters, state donated as the update
  donates it, best of `repeats` after a warm-up: the project's step (`optim`: one
  global-norm pass for the finiteness test, the clipping and the metric; then AdamW),
  and AdamW alone on the same arrays (what the step's extra work is measured against)."""
  from flax import nnx
  import optax

  from pipe_rlhf_jax.optim import apply_if_finite, make_optimizer

  params = nnx.state(nnx.eval_shape(lambda: init_model(cfg)), nnx.Param)
  params = jax.tree.map(lambda x: jnp.full(x.shape, 0.5, x.dtype), params)
  grads = jax.tree.map(lambda x: jnp.full(x.shape, 1e-3, x.dtype), params)
  tx, adamw = make_optimizer(1e-6, total_steps=10), optax.adamw(1e-6)

  def project(params, opt, grads):
    return apply_if_finite(tx, params, opt, grads, jnp.float32(1.0))[:2]

  def alone(params, opt, grads):
    updates, opt = adamw.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  out = {}
  for name, fn, init in (("optimizer_s", project, tx.init),
                         ("adamw_s", alone, adamw.init)):
    step = jax.jit(fn, donate_argnums=(0, 1))
    state = (jax.tree.map(jnp.copy, params), init(params))
    times = []
    for _ in range(repeats + 1):
      t0 = time.perf_counter()
      state = jax.block_until_ready(step(*state, grads))
      times.append(time.perf_counter() - t0)
    out[name] = min(times[1:])
  return out


def bench_size(size: int, steps: int, warmup: int, scan_unroll: int) -> dict:
  layers, embed, heads, kv, mlp, vocab, batch, prompt, gen = SIZES[size]
  cfg = tiny_config(vocab_size=vocab, embed_dim=embed, num_layers=layers, num_heads=heads,
                    num_kv_heads=kv, head_dim=embed // heads, mlp_dim=mlp)
  devices = jax.devices()[:1]
  system = PPOSystem(
      Models.from_policy(init_model(cfg, seed=0)),
      ppo=PPOConfig(steps=steps, batch_size=batch, minibatch_size=batch, epochs=1,
                    actor_lr=1e-5, critic_lr=1e-5),
      sampling=SamplingParams(max_new_tokens=gen, temperature=1.0, eos_id=None, pad_id=0),
      runtime=Plan(mode="sequential", mesh=MeshSpec(data=1),
                            **{stage: StagePlan(scan_unroll=scan_unroll or layers)
                               for stage in ("generate", "infer", "train")}),
      reward_fn=lambda prompts, completions: [float(len(c)) for c in completions],
      decode=lambda ids: " ".join(str(int(i)) for i in ids), devices=devices)
  rng = np.random.default_rng(0)

  def prompts():
    index = 0
    while True:
      yield {"prompt_tokens": rng.integers(3, vocab, (batch, prompt)).astype(np.int32),
             "prompt_mask": np.ones((batch, prompt), bool),
             "index": np.arange(index, index + batch)}
      index += batch

  t0 = time.perf_counter()
  metrics = run(system, prompts(), steps).metrics
  wall = time.perf_counter() - t0
  steady = metrics[warmup:]
  mean = lambda key: float(np.mean([m[key] for m in steady]))
  length = prompt + gen
  actor, critic = cfg, cfg.replace(head="value")
  work = {
      "generate": (flops.forward_flops(actor, batch, prompt, head_positions=1)
                   + sum(flops.forward_flops(actor, batch, 1, context=prompt + t)
                         for t in range(gen - 1))),
      "infer": (flops.forward_flops(actor, batch, length, head_positions=gen)
                + flops.forward_flops(critic, batch, length, head_positions=gen)),
      "train": (flops.train_flops(actor, batch, length, head_positions=gen)
                + flops.train_flops(critic, batch, length, head_positions=gen)),
  }
  times = {"generate": mean("time/generate_s"), "infer": mean("time/infer_s"),
           "train": mean("time/train_s")}
  step_s = mean("time/step_s")
  decode_bytes = sum(flops.decode_step_bytes(actor, batch, prompt + t) for t in range(gen))
  # The update's own GEMM shapes (the actor's; the critic's are the same but its head).
  train_shapes = gemm_shapes(actor, batch * length, batch * gen)
  return {
      "train_shapes_gflops": shape_rate(train_shapes),
      "size": size, "dims": SIZES[size], "params": cfg.num_params(), "steps": steps,
      "scan_unroll": scan_unroll or layers,
      "warmup": warmup, "wall_s": wall, "s_per_step": step_s,
      **{f"{k}_s": v for k, v in times.items()},
      "other_s": step_s - sum(times.values()),
      **{f"{k}_gflops": work[k] / times[k] / 1e9 for k in work},
      "decode_gbps": decode_bytes / times["generate"] / 1e9,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes", default="1,2,3")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--scan-unroll", type=int, default=0,
                      help="layers per iteration of the layer scan (0: all of them)")
  parser.add_argument("--out-dir", default=os.path.join(_ROOT, "experiments", "out",
                                                        "bench_ppo_step"))
  parser.add_argument("--page", action="store_true", help="write docs/results/ppo_step.md")
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
  command = "python " + " ".join([os.path.relpath(__file__, _ROOT)] + sys.argv[1:])
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
    path = results.write_page("ppo_step", "Seconds per PPO step at toy sizes",
                              "\n".join(body), limits)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
