"""Benchmark: a layer scan's forward+backward with 3-D einsum projections vs 2-D matmuls.

Owns the measurement behind `models.transformer.dense`: a stack of SwiGLU MLP blocks
(the projections that dominate a transformer's FLOPs) under `lax.scan`, differentiated
with `jax.value_and_grad`, written two ways that compute the same function:
  - `einsum3d`: `jnp.einsum("ble,ef->blf", x, w)` on `[batch, length, embed]`;
  - `dense2d`: the token dimensions flattened first, `[tokens, embed] @ [embed, mlp]`
    (what the model does).
The variants alternate within one process (best of --repeats each), so machine load
hits both alike; the compiled HLO's transpose count is printed beside the times.

Usage:
  python -m experiments.bench_projection_layout
  python -m experiments.bench_projection_layout --batch 16 --length 64 --embed 256 --mlp 512

Writes projection_layout.json to --out-dir (default experiments/out/bench_projection_layout/).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def einsum3d(x, w):
  gate = jnp.einsum("ble,ef->blf", x, w["gate"])
  up = jnp.einsum("ble,ef->blf", x, w["up"])
  return x + jnp.einsum("blf,fe->ble", jax.nn.silu(gate) * up, w["down"])


def dense2d(x, w):
  batch, length, embed = x.shape
  tokens = x.reshape(batch * length, embed)  # [tokens, embed]
  hidden = jax.nn.silu(tokens @ w["gate"]) * (tokens @ w["up"])  # [tokens, mlp]
  return x + (hidden @ w["down"]).reshape(batch, length, embed)


def grad_fn(block):
  def loss(weights, x):
    h, _ = jax.lax.scan(lambda h, w: (block(h, w), None), x, weights)
    return jnp.mean(h ** 2)
  return jax.jit(jax.value_and_grad(loss))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--length", type=int, default=64)
  parser.add_argument("--embed", type=int, default=256)
  parser.add_argument("--mlp", type=int, default=512)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument("--out-dir", default=os.path.join(_ROOT, "experiments", "out",
                                                        "bench_projection_layout"))
  args = parser.parse_args()
  keys = jax.random.split(jax.random.key(0), 4)
  n, e, f = args.layers, args.embed, args.mlp
  weights = {"gate": 0.02 * jax.random.normal(keys[0], (n, e, f)),
             "up": 0.02 * jax.random.normal(keys[1], (n, e, f)),
             "down": 0.02 * jax.random.normal(keys[2], (n, f, e))}
  x = jax.random.normal(keys[3], (args.batch, args.length, e))
  fns = {"einsum3d": grad_fn(einsum3d), "dense2d": grad_fn(dense2d)}
  a, b = (jax.device_get(fn(weights, x)) for fn in fns.values())
  assert jnp.allclose(a[0], b[0], rtol=1e-5), "the two variants must compute the same loss"
  times = {name: [] for name in fns}
  for _ in range(args.repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(weights, x))
      times[name].append(time.perf_counter() - start)
  # forward 2 * tokens * 3 matmuls; backward twice that.
  flops = 3 * n * 3 * 2 * args.batch * args.length * e * f
  result = {"backend": jax.default_backend(), "args": vars(args), "variants": {}}
  for name, fn in fns.items():
    best = min(times[name])
    hlo = fn.lower(weights, x).compile().as_text()
    result["variants"][name] = {"best_s": best, "gflops": flops / best / 1e9,
                                "transposes": hlo.count(" transpose(")}
    print(f"{name:9s} {best * 1e3:8.1f} ms  {flops / best / 1e9:6.1f} GFLOP/s  "
          f"transposes in HLO: {result['variants'][name]['transposes']}")
  os.makedirs(args.out_dir, exist_ok=True)
  with open(os.path.join(args.out_dir, "projection_layout.json"), "w") as out:
    json.dump(result, out, indent=1)


if __name__ == "__main__":
  main()
