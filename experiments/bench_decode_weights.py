"""Benchmark: how a decode step reads its layers' weights, at one token per row.

Owns one measurement behind two choices of the decoder: the GB/s at which a jitted
program streams a stack of layers' MLP weights for a batch of single tokens (a decode
step's regime: the weights are read once, the activations are tiny), when the layers are

- `scan xs`: the stacked `[layers, ...]` arrays scanned by `lax.scan` (the model's layer
  scan, used everywhere but the decode loop);
- `scan index`: the same scan indexing the stacked arrays;
- `unrolled slices`: a Python loop slicing the stacked arrays (the layer scan unrolled);
- `separate arrays`: one array per layer, as `Layers.per_layer` gives the decode loop;

and, on separate arrays, q/k/v and gate/up as separate matmuls against one fused matmul
each (concatenated weights). The rates are read against the machine's memory bandwidth,
measured in the same run. Defaults: SmolLM2-135M's widths (d576, ffn 1536, 9 / 3 heads of
64), 8 layers, batch 8, f32, one device; best of 20 calls.

Usage:
  python -m experiments.bench_decode_weights
  python -m experiments.bench_decode_weights --layers 30 --page

Writes experiments/out/bench_decode_weights.json and, with --page,
docs/results/decode_weights.md.
"""

from __future__ import annotations

import argparse
import json
import os

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import results  # noqa: E402


def _best(fn) -> float:
  return results.best_of(fn, repeats=20)


def mlp_variants(layers: int, embed: int, mlp: int, batch: int
                 ) -> tuple[dict[str, float], int]:
  """Seconds of one pass over `layers` MLPs (x @ up, then @ down) per weight layout."""
  rng = np.random.default_rng(0)
  up = jnp.asarray(rng.normal(size=(layers, embed, mlp)).astype(np.float32) * 0.01)
  down = jnp.asarray(rng.normal(size=(layers, mlp, embed)).astype(np.float32) * 0.01)
  x = jnp.ones((batch, embed), jnp.float32)  # [batch, embed]: one token per row

  @jax.jit
  def scan_xs(up, down, x):
    def body(h, w):
      return h + (h @ w[0]) @ w[1], None
    return jax.lax.scan(body, x, (up, down))[0]

  @jax.jit
  def scan_index(up, down, x):
    def body(h, i):
      return h + (h @ up[i]) @ down[i], None
    return jax.lax.scan(body, x, jnp.arange(layers))[0]

  @jax.jit
  def unrolled(up, down, x):
    h = x
    for i in range(layers):
      h = h + (h @ up[i]) @ down[i]
    return h

  @jax.jit
  def separate(ups, downs, x):
    h = x
    for a, b in zip(ups, downs):
      h = h + (h @ a) @ b
    return h

  ups, downs = [up[i] for i in range(layers)], [down[i] for i in range(layers)]
  return {
      "scan xs": _best(lambda: scan_xs(up, down, x).block_until_ready()),
      "scan index": _best(lambda: scan_index(up, down, x).block_until_ready()),
      "unrolled slices": _best(lambda: unrolled(up, down, x).block_until_ready()),
      "separate arrays": _best(lambda: separate(ups, downs, x).block_until_ready()),
  }, (up.nbytes + down.nbytes)


def fusion_variants(layers: int, embed: int, mlp: int, heads: int, kv_heads: int,
                    head_dim: int, batch: int) -> tuple[dict[str, float], int]:
  """Seconds of one pass over `layers` blocks' projections, q/k/v and gate/up as
  separate matmuls or as one fused matmul each (separate arrays per layer)."""
  rng = np.random.default_rng(0)
  w = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32) * 0.01)
  q_out, kv_out = heads * head_dim, kv_heads * head_dim
  groups = heads // kv_heads
  sep = [dict(q=w(embed, q_out), k=w(embed, kv_out), v=w(embed, kv_out), o=w(q_out, embed),
              g=w(embed, mlp), u=w(embed, mlp), d=w(mlp, embed)) for _ in range(layers)]
  fused = [dict(qkv=jnp.concatenate([p["q"], p["k"], p["v"]], 1), o=p["o"],
                gu=jnp.concatenate([p["g"], p["u"]], 1), d=p["d"]) for p in sep]
  x = jnp.ones((batch, embed), jnp.float32)

  def attend(q, k, v):  # a stand-in mixing q with the kv heads, elementwise
    return q + jnp.tile(k, (1, groups)) + jnp.tile(v, (1, groups))

  @jax.jit
  def separate(ps, x):
    h = x
    for p in ps:
      h = h + attend(h @ p["q"], h @ p["k"], h @ p["v"]) @ p["o"]
      h = h + (jax.nn.silu(h @ p["g"]) * (h @ p["u"])) @ p["d"]
    return h

  @jax.jit
  def fused_fn(ps, x):
    h = x
    for p in ps:
      qkv = h @ p["qkv"]
      h = h + attend(qkv[:, :q_out], qkv[:, q_out:q_out + kv_out],
                     qkv[:, q_out + kv_out:]) @ p["o"]
      gu = h @ p["gu"]
      h = h + (jax.nn.silu(gu[:, :mlp]) * gu[:, mlp:]) @ p["d"]
    return h

  nbytes = sum(a.nbytes for p in sep for a in p.values())
  return {"separate q/k/v, gate/up": _best(lambda: separate(sep, x).block_until_ready()),
          "fused qkv, gate_up": _best(lambda: fused_fn(fused, x).block_until_ready())}, nbytes


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split(
      "\nUsage:")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--embed", type=int, default=576)
  parser.add_argument("--mlp", type=int, default=1536)
  parser.add_argument("--heads", type=int, default=9)
  parser.add_argument("--kv-heads", type=int, default=3)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--out", default=os.path.join(_ROOT, "experiments", "out",
                                                    "bench_decode_weights.json"))
  results.add_page_flag(parser, "decode_weights")
  args = parser.parse_args(argv)
  limits = results.machine_limits()
  layouts, mlp_bytes = mlp_variants(args.layers, args.embed, args.mlp, args.batch)
  fusion, block_bytes = fusion_variants(args.layers, args.embed, args.mlp, args.heads,
                                        args.kv_heads, args.head_dim, args.batch)
  rows = ([{"case": k, "what": "MLP weights", "seconds": v, "bytes": mlp_bytes}
           for k, v in layouts.items()]
          + [{"case": k, "what": "block projections", "seconds": v, "bytes": block_bytes}
             for k, v in fusion.items()])
  for r in rows:
    r["gbps"] = r["bytes"] / r["seconds"] / 1e9
    r["bandwidth_fraction"] = r["gbps"] / limits["mem_gbps"]
    print(f"{r['what']:>18} | {r['case']:<24} {r['seconds'] * 1e3:7.2f} ms  "
          f"{r['gbps']:5.1f} GB/s ({r['bandwidth_fraction']:.0%} of the measured bandwidth)")
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump({"args": vars(args), "limits": limits, "rows": rows}, f, indent=1)
  if args.page:
    body = [__doc__.split("\nUsage:")[0].split("\n", 1)[1].strip(), "",
            f"{args.layers} layers, d{args.embed}, ffn {args.mlp}, {args.heads} / "
            f"{args.kv_heads} heads of {args.head_dim}, batch {args.batch}, f32.", "",
            "| weights | layout | ms | GB/s | of the measured bandwidth |",
            "|---|---|---|---|---|"]
    body += [f"| {r['what']} | {r['case']} | {r['seconds'] * 1e3:.2f} | {r['gbps']:.1f} | "
             f"{r['bandwidth_fraction']:.0%} |" for r in rows]
    path = results.write_page(args.page, "How a decode step reads its weights",
                              "\n".join(body), limits)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
