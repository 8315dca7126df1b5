"""Benchmark: device memory of the train, inference and decode steps vs sequence length.

Owns one comparison, read from XLA's own accounting (`compiled.memory_analysis()`, nothing
is executed): for a small model at vocabulary sizes 32k and 128k and sequence lengths 512
.. 8192 (half prompt, half completion), the peak memory of
  train    value_and_grad of the completion log-probs (what the PPO actor update does),
  infer    the completion log-probs, forward only (reference / behaviour log-probs),
  decode   one cached decode step over a cache of `length` slots,
under two settings:
  before   dense attention, no remat, the head on every position and a full f32
           log-softmax over `[batch, length, vocab]` (the naive computation);
  after    blockwise attention, full per-layer remat, the head on the completion
           positions only and the log-softmax in chunks of 256 positions
           (`stages.common.completion_logprobs` with `logits_chunk_size`).
Peak = arguments + outputs + XLA temporaries - aliased bytes. It also reports, for a
memory budget (--budget-gib), the longest length of the sweep that fits.

Usage:
  python -m experiments.bench_memory
  python -m experiments.bench_memory --lengths 512,2048 --vocabs 32768 --budget-gib 0.5

Writes memory.json and memory.md to --out-dir (default experiments/out/bench_memory/).
"""

from __future__ import annotations

import argparse
import json
import os
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from flax import nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments import results  # noqa: E402
from pipe_rlhf_jax.models import KVCache, init_model, tiny_config  # noqa: E402
from pipe_rlhf_jax.stages import common  # noqa: E402

SETTINGS = {
    "before": dict(attention="dense", remat="none", chunk=0, slice_first=False),
    "after": dict(attention="blockwise", remat="full", chunk=256, slice_first=True),
}


def completion_logprobs(model, tokens, mask, completion_len, setting):
  """Log-probs [batch, completion_len] of the completion tokens, the chosen way."""
  prompt_len = tokens.shape[1] - completion_len
  targets = tokens[:, prompt_len:]
  if not setting["slice_first"]:
    logits = model(tokens, mask)  # [batch, length, vocab] f32
    logp = jax.nn.log_softmax(logits[:, prompt_len - 1:-1], axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  graphdef, params = nnx.split(model)
  return common.completion_logprobs(graphdef, params, tokens[:, :prompt_len],
                                    mask[:, :prompt_len], targets, mask[:, prompt_len:])


def peak_bytes(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  args, out, temp = m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes
  alias = getattr(m, "alias_size_in_bytes", 0)
  return {"peak": args + out + temp - alias, "temp": temp, "args": args}


def measure(cfg, step: str, length: int, batch: int, setting) -> dict[str, int]:
  cfg = cfg.replace(attention=setting["attention"], remat=setting["remat"],
                    attention_block_size=512, logits_chunk_size=setting["chunk"])
  graphdef, params = nnx.split(nnx.eval_shape(lambda: init_model(cfg)))
  tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  mask = jax.ShapeDtypeStruct((batch, length), jnp.bool_)
  completion_len = length // 2
  if step == "train":
    def loss(params, tokens, mask):
      lp = completion_logprobs(nnx.merge(graphdef, params), tokens, mask, completion_len,
                               setting)
      return -jnp.mean(lp)
    fn = jax.value_and_grad(loss)
    args = (params, tokens, mask)
  elif step == "infer":
    fn = lambda params, tokens, mask: completion_logprobs(
        nnx.merge(graphdef, params), tokens, mask, completion_len, setting)
    args = (params, tokens, mask)
  else:  # decode: one token at the last slot of a `length`-slot cache
    cache = jax.eval_shape(lambda: KVCache.zeros(cfg, batch, length))

    def fn(params, cache, token, key_mask):
      model = nnx.merge(graphdef, params)
      positions = jnp.full((batch, 1), length - 1, jnp.int32)
      return model.forward_cached(token, positions, key_mask, cache, length - 1)
    args = (params, cache, jax.ShapeDtypeStruct((batch, 1), jnp.int32), mask)
  return peak_bytes(jax.jit(fn).lower(*args).compile())


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--lengths", default="512,1024,2048,4096,8192")
  parser.add_argument("--vocabs", default="32768,131072")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--embed-dim", type=int, default=256)
  parser.add_argument("--num-layers", type=int, default=2)
  parser.add_argument("--budget-gib", type=float, default=1.0)
  parser.add_argument("--out-dir", default=os.path.join(_ROOT, "experiments", "out",
                                                        "bench_memory"))
  results.add_page_flag(parser, "memory")
  args = parser.parse_args()
  lengths = [int(x) for x in args.lengths.split(",")]
  vocabs = [int(x) for x in args.vocabs.split(",")]
  os.makedirs(args.out_dir, exist_ok=True)
  rows = []
  for vocab in vocabs:
    cfg = tiny_config(vocab_size=vocab, embed_dim=args.embed_dim, num_layers=args.num_layers,
                      num_heads=4, num_kv_heads=2, head_dim=64, mlp_dim=3 * args.embed_dim,
                      max_position_embeddings=max(lengths))
    for step in ("train", "infer", "decode"):
      for length in lengths:
        row = {"vocab": vocab, "step": step, "length": length, "batch": args.batch}
        for name, setting in SETTINGS.items():
          t0 = time.perf_counter()
          m = measure(cfg, step, length, args.batch, setting)
          row[f"{name}_peak_mib"] = m["peak"] / 2**20
          row[f"{name}_temp_mib"] = m["temp"] / 2**20
          row[f"{name}_compile_s"] = time.perf_counter() - t0
        rows.append(row)
        print(f"vocab {vocab:>6} {step:>6} L={length:>5}: before {row['before_peak_mib']:9.1f} "
              f"MiB  after {row['after_peak_mib']:9.1f} MiB", flush=True)
  budget_mib = args.budget_gib * 1024
  fits = {}
  for vocab in vocabs:
    for step in ("train", "infer", "decode"):
      for name in SETTINGS:
        ok = [r["length"] for r in rows if r["vocab"] == vocab and r["step"] == step
              and r[f"{name}_peak_mib"] <= budget_mib]
        fits[f"{vocab}/{step}/{name}"] = max(ok) if ok else None
  command = results.command_line()
  with open(os.path.join(args.out_dir, "memory.json"), "w", encoding="utf-8") as f:
    json.dump({"command": command, "backend": jax.default_backend(), "rows": rows,
               "budget_gib": args.budget_gib, "longest_that_fits": fits}, f, indent=2)
  lines = [f"`{command}` ({jax.default_backend()}, batch {args.batch}, {args.num_layers} "
           f"layers, d={args.embed_dim}, f32)", "",
           "| vocab | step | length | before: peak MiB (temporaries) | after: peak MiB "
           "(temporaries) | after: temporaries KiB/token |", "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['vocab']} | {r['step']} | {r['length']} | "
                 f"{r['before_peak_mib']:.1f} ({r['before_temp_mib']:.1f}) | "
                 f"{r['after_peak_mib']:.1f} ({r['after_temp_mib']:.1f}) | "
                 f"{r['after_temp_mib'] * 1024 / r['length']:.1f} |")
  lines += ["", f"Longest length of the sweep within {args.budget_gib} GiB:", "",
            "| vocab | step | before | after |", "|---|---|---|---|"]
  for vocab in vocabs:
    for step in ("train", "infer", "decode"):
      lines.append(f"| {vocab} | {step} | {fits[f'{vocab}/{step}/before']} | "
                   f"{fits[f'{vocab}/{step}/after']} |")
  with open(os.path.join(args.out_dir, "memory.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  if args.page:
    # XLA's compiled memory analysis does not depend on the machine's speed.
    what = __doc__.split("\nUsage:")[0].split("\n", 1)[1].strip()  # the settings compared
    path = results.write_page(args.page, "Memory at long lengths",
                              what + "\n\n" + "\n".join(lines[1:]), None, command=command)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
