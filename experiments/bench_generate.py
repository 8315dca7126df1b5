"""Benchmark of the plain KV-cache sampler: prefill and decode tokens/s per batch size.

Owns one measurement: for the embedded tiny model (models.config.tiny_config), or a
published shape with random weights (`--shape`, `models/shapes.py`), on the default
backend (CPU here, GPU if present), compile time of the jitted prefill and decode
(reported separately, via AOT lower/compile) and steady-state throughput:
  prefill tokens/s = batch * prompt_len / prefill seconds
  decode tokens/s  = batch * (new_tokens - 1) / decode seconds
EOS is disabled so every run decodes exactly `new_tokens` positions. With
`--group-sizes 1,4` each batch is also run as batch / n distinct prompts of n samples
each (a GRPO / RLOO group), which the sampler prefills once per prompt: prefill seconds
fall by about n while tokens/s counts every row.

Usage:
  python -m experiments.bench_generate --batch-sizes 1,8,32 --prompt-len 32 \
      --new-tokens 32   # writes experiments/out/bench_generate.csv (git-ignored)
  python -m experiments.bench_generate --shape smollm2-135m --layers 4 --batch-sizes 8 \
      --group-sizes 1,4 --prompt-len 256 --new-tokens 8
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from flax import nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pipe_rlhf_jax.generation import sampler  # noqa: E402
from pipe_rlhf_jax.models import shapes  # noqa: E402
from pipe_rlhf_jax.models.config import tiny_config  # noqa: E402
from pipe_rlhf_jax.models.transformer import init_model  # noqa: E402


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch-sizes", default="1,8,32",
                      help="comma-separated batch sizes")
  parser.add_argument("--group-sizes", default="1",
                      help="comma-separated samples per prompt (each must divide the batch)")
  parser.add_argument("--shape", default="",
                      help="a published shape of models/shapes.py (random weights); "
                           "default: the embedded tiny model")
  parser.add_argument("--layers", type=int, default=0,
                      help="with --shape: override its layer count")
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=3,
                      help="timed runs per batch size (median reported)")
  parser.add_argument("--temperature", type=float, default=1.0)
  parser.add_argument("--top-k", type=int, default=0)
  parser.add_argument("--top-p", type=float, default=1.0)
  # Under the repository's git-ignored experiments/out/, not the current directory.
  parser.add_argument("--out", default=os.path.join(_ROOT, "experiments", "out",
                                                    "bench_generate.csv"),
                      help="CSV output path")
  return parser.parse_args(argv)


def bench_one(graphdef, state, vocab, batch, args, group_size=1):
  """Compiles and times prefill and decode for one batch size (of batch / group_size
  prompts, group_size samples each); returns a row dict."""
  params = sampler.SamplingParams(max_new_tokens=args.new_tokens,
                                  temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, eos_id=None)
  prefill, decode = sampler.make_generate_fns(graphdef, params, group_size=group_size)
  rs = np.random.RandomState(batch)
  prompt = rs.randint(1, vocab, (batch // group_size, args.prompt_len))
  prompt = jnp.asarray(np.repeat(prompt, group_size, axis=0), jnp.int32)  # [batch, P]
  mask = jnp.ones((batch, args.prompt_len), bool)
  ids = jnp.arange(batch, dtype=jnp.int32)
  rng = jax.random.key(0)

  start = time.perf_counter()
  prefill_c = prefill.lower(state, prompt, mask, rng, ids).compile()
  prefill_compile = time.perf_counter() - start
  first = prefill_c(state, prompt, mask, rng, ids)
  start = time.perf_counter()
  decode_c = decode.lower(state, first, mask, rng, ids).compile()
  decode_compile = time.perf_counter() - start
  jax.block_until_ready(decode_c(state, first, mask, rng, ids))  # warm-up

  prefill_s, decode_s = [], []
  for _ in range(args.repeats):
    start = time.perf_counter()
    first = jax.block_until_ready(prefill_c(state, prompt, mask, rng, ids))
    prefill_s.append(time.perf_counter() - start)
    start = time.perf_counter()
    final = jax.block_until_ready(decode_c(state, first, mask, rng, ids))
    decode_s.append(time.perf_counter() - start)
  assert int(final.step) == args.new_tokens
  prefill_t, decode_t = statistics.median(prefill_s), statistics.median(decode_s)
  decode_tokens = batch * max(args.new_tokens - 1, 1)
  return dict(
      backend=jax.default_backend(), batch=batch, group_size=group_size,
      prompt_len=args.prompt_len,
      new_tokens=args.new_tokens, prefill_compile_s=round(prefill_compile, 3),
      decode_compile_s=round(decode_compile, 3), prefill_s=round(prefill_t, 5),
      decode_s=round(decode_t, 5),
      prefill_tok_s=round(batch * args.prompt_len / prefill_t, 1),
      decode_tok_s=round(decode_tokens / decode_t, 1),
      decode_ms_per_step=round(1e3 * decode_t / max(args.new_tokens - 1, 1), 3))


def main(argv=None):
  args = parse_args(argv)
  if args.shape:
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    cfg = shapes.config(args.shape, dtype="float32", **overrides)
    name = f"{args.shape} ({cfg.num_layers} layers)"
  else:
    cfg, name = tiny_config(), "tiny_config"
  model = init_model(cfg, seed=0)
  graphdef, state = nnx.split(model)
  rows = [bench_one(graphdef, state, model.config.vocab_size, int(b), args, int(n))
          for b in args.batch_sizes.split(",") for n in args.group_sizes.split(",")]
  columns = list(rows[0])
  print(f"{name} ({model.config.num_params():,} params) on "
        f"{jax.default_backend()} x{jax.device_count()}")
  widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
  print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
  for row in rows:
    print("  ".join(str(row[c]).rjust(w) for c, w in zip(columns, widths)))
  parent = os.path.dirname(os.path.abspath(args.out))
  os.makedirs(parent, exist_ok=True)
  with open(args.out, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
