"""Benchmark of sampler timing: the plain KV-cache sampler per batch size and beside pipelines.

Owns the generation timings, in two comparisons:

- by default, the plain sampler per batch size: for the embedded tiny model
  (models.config.tiny_config), or a published shape with random weights (`--shape`,
  `models/shapes.py`), on one device of the default backend (CPU here, GPU if present),
  compile time of the jitted prefill and decode (reported separately, via AOT
  lower/compile) and steady-state throughput:
    prefill tokens/s = batch * prompt_len / prefill seconds
    decode tokens/s  = batch * (new_tokens - 1) / decode seconds
  With `--group-sizes 1,4` each batch is also run as batch / n distinct prompts of n
  samples each (a GRPO / RLOO group), which the sampler prefills once per prompt: prefill
  seconds fall by about n while tokens/s counts every row.
- `--variants` (alone: every variant), the plain sampler on several meshes beside delayed
  inter-batch pipelined generation, on 8 devices (virtual CPU ones unless a real
  accelerator is present), the same model (tiny_config) and prompt batch (one batch size)
  for every variant:
    single       plain KV-cache sampler on one device
    data8        plain sampler, batch split over data=8
    tensor2      plain sampler, tensor=2 (tiny_config has 2 KV heads, so 2 is the max)
    naive P4 M1  pipeline with one micro-batch: the ring is mostly bubbles
    delayed P4 M4 / M8, and P2 M2 / M4: delayed inter-batch pipelining
    delayed P4 M8 padded: the same, with prompt-length ring messages on every tick
      (how much the prefill/decode split of the message buffer saves)
    delayed P4xT2 M8: pipeline stages that are themselves tensor-parallel
  For each it prints tokens/s (generated tokens / median wall time, compile excluded and
  reported separately; `vs_single` divides it by the one-device sampler's), the measured
  slot utilisation (busy (tick, stage) slots in the executed schedule / all slots) next
  to the schedule's theoretical value, and the peak memory per device. CPU devices expose
  no `memory_stats`, so memory is then XLA's compiled memory analysis (arguments +
  outputs + temporaries - aliased, per device), which the CSV marks as `xla_estimate`. On
  virtual CPU devices all "devices" share the host's cores, so wall-clock speedups from
  pipelining are not expected there; utilisation and memory are the meaningful columns.

EOS is disabled in both, so every run decodes exactly `new_tokens` positions. The flags
of the batch-size sweep alone (`--group-sizes`, `--shape`, `--layers`, `--top-k`,
`--top-p`) are refused with `--variants`.

Usage:
  python -m experiments.bench_generate --batch-sizes 1,8,32 --prompt-len 32 \
      --new-tokens 32   # writes experiments/out/bench_generate/batch_sizes.csv
  python -m experiments.bench_generate --shape smollm2-135m --layers 4 --batch-sizes 8 \
      --group-sizes 1,4 --prompt-len 256 --new-tokens 8
  python -m experiments.bench_generate --variants
  python -m experiments.bench_generate --variants "single,delayed P4 M4"

Writes under --out-dir (default `experiments/out/bench_generate/`, git-ignored, wherever
the script is started from) batch_sizes.csv, or with `--variants` variants.csv and one
schedule PNG per pipelined variant.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from pipe_rlhf_jax.generation import pipelined, sampler
from pipe_rlhf_jax.generation import schedule as sched
from pipe_rlhf_jax.host_devices import use_virtual_cpu_devices
from pipe_rlhf_jax.models import shapes
from pipe_rlhf_jax.models.config import tiny_config
from pipe_rlhf_jax.models.transformer import init_model, param_axes
from pipe_rlhf_jax.parallel.logical import DEFAULT_RULES, axis_rules, tree_shardings
from pipe_rlhf_jax.parallel.mesh import MeshShape, make_mesh

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT_DIR = os.path.join(_ROOT, "experiments", "out", "bench_generate")
# Per comparison: the defaults of the flags both take.
DEFAULTS = {"batch_sizes": dict(batch_sizes="1,8,32", prompt_len=32, new_tokens=32),
            "variants": dict(batch_sizes="32", prompt_len=16, new_tokens=16)}
# The flags of the batch-size sweep alone, with their defaults.
SWEEP_DEFAULTS = dict(group_sizes="1", shape="", layers=0, top_k=0, top_p=1.0)
_ALL = "all"


def parse_args(argv=None) -> argparse.Namespace:
  """The flags, with the defaults of the comparison asked for filled in; `args.variants`
  is None for the batch-size sweep, else the set of variant names (empty: all)."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split(
      "\nUsage:")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--variants", nargs="?", const=_ALL, default=None, metavar="NAMES",
                      help="compare the plain sampler on several meshes with the pipelined "
                      "decoders on 8 devices: comma-separated variant names (alone: all); "
                      "the first plain variant run is the token reference")
  parser.add_argument("--batch-sizes", help="comma-separated batch sizes (default 1,8,32; "
                      "with --variants one, default 32)")
  parser.add_argument("--prompt-len", type=int, help="default 32 (with --variants 16)")
  parser.add_argument("--new-tokens", type=int, help="default 32 (with --variants 16)")
  parser.add_argument("--repeats", type=int, default=3,
                      help="timed runs of each measurement (median reported)")
  parser.add_argument("--temperature", type=float, default=1.0)
  sweep = parser.add_argument_group("the batch-size sweep only (without --variants)")
  sweep.add_argument("--group-sizes",
                     help="comma-separated samples per prompt (each must divide the batch; "
                          "default 1)")
  sweep.add_argument("--shape", help="a published shape of models/shapes.py (random "
                     "weights); default: the embedded tiny model")
  sweep.add_argument("--layers", type=int, help="with --shape: override its layer count")
  sweep.add_argument("--top-k", type=int, help="default 0: off")
  sweep.add_argument("--top-p", type=float, help="default 1.0: off")
  # Under the repository's git-ignored experiments/out/, not the current directory.
  parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
  args = parser.parse_args(argv)
  if args.variants is not None:
    given = ["--" + k.replace("_", "-") for k in SWEEP_DEFAULTS if getattr(args, k) is not None]
    if given:
      parser.error(f"{', '.join(given)}: for the batch-size sweep only (without --variants)")
    if args.batch_sizes is not None and "," in args.batch_sizes:
      parser.error("--variants compares at one batch size: give --batch-sizes one value")
    args.variants = {v.strip() for v in args.variants.split(",")
                     if v.strip() and args.variants != _ALL}
  mode = "batch_sizes" if args.variants is None else "variants"
  for key, value in {**SWEEP_DEFAULTS, **DEFAULTS[mode]}.items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  return args


# ---- the plain sampler per batch size ---------------------------------------------------

def bench_one(graphdef, state, vocab, batch, args, group_size=1):
  """Compiles and times prefill and decode for one batch size (of batch / group_size
  prompts, group_size samples each); returns a row dict."""
  params = sampler.SamplingSettings(max_new_tokens=args.new_tokens,
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


def run_batch_sizes(args) -> None:
  """The batch-size sweep of the plain sampler on one device; writes batch_sizes.csv."""
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
  print(f"{name} ({model.config.num_params():,} params) on "
        f"{jax.default_backend()} x{jax.device_count()}")
  print(f"wrote {show_and_write(rows, os.path.join(args.out_dir, 'batch_sizes.csv'))}")


# ---- the plain sampler beside the pipelined decoders -----------------------------------

def memory_per_device(compiled_list):
  """(bytes, source): device peak if the backend reports it, else XLA's estimate."""
  stats = jax.devices()[0].memory_stats()
  if stats and "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"]), "device_peak"
  peaks = []
  for compiled in compiled_list:
    m = compiled.memory_analysis()
    peaks.append(m.argument_size_in_bytes + m.output_size_in_bytes +
                 m.temp_size_in_bytes - m.alias_size_in_bytes)
  return max(peaks), "xla_estimate"


def timed(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times), result


def bench_plain(name, model, prompt, mask, args, shape: MeshShape):
  """Plain sampler on a data / tensor mesh (parameters laid out by the default rules)."""
  mesh = make_mesh(shape, jax.devices()[:shape.size])
  graphdef, state = nnx.split(model)
  state = jax.device_put(state, tree_shardings(mesh, param_axes(model), DEFAULT_RULES))
  params = sampler.SamplingSettings(max_new_tokens=args.new_tokens,
                                  temperature=args.temperature, eos_id=None)
  ids = jnp.arange(args.batch, dtype=jnp.int32)
  rng = jax.random.key(0)
  with axis_rules(mesh, DEFAULT_RULES):
    prefill, decode = sampler.make_generate_fns(graphdef, params)
    start = time.perf_counter()
    prefill_c = prefill.lower(state, prompt, mask, rng, ids).compile()
    first = prefill_c(state, prompt, mask, rng, ids)
    decode_c = decode.lower(state, first, mask, rng, ids).compile()
    compile_s = time.perf_counter() - start
  run = lambda: decode_c(state, prefill_c(state, prompt, mask, rng, ids), mask, rng, ids)
  jax.block_until_ready(run())
  seconds, final = timed(run, args.repeats)
  memory, source = memory_per_device([prefill_c, decode_c])
  return dict(variant=name, devices=shape.size, pipeline=1, microbatches=1,
              tensor=shape.tensor, data=shape.data, compile_s=round(compile_s, 2),
              seconds=round(seconds, 4),
              tokens_per_s=round(args.batch * args.new_tokens / seconds, 1),
              ticks="", utilization_measured="", utilization_theory="",
              memory_per_device_kb=round(memory / 1024, 1), memory_source=source), final


def bench_pipeline(name, model, prompt, mask, args, pipe, num_mb, tensor=1,
                   split=True, out_dir="."):
  mesh = make_mesh(MeshShape(pipeline=pipe, tensor=tensor), jax.devices()[:pipe * tensor])
  prepared = pipelined.prepare_pipelined(
      model, prompt, mask, args.new_tokens, mesh=mesh, num_microbatches=num_mb,
      rng=jax.random.key(0), temperature=args.temperature, eos_id=None,
      split_segments=split)
  start = time.perf_counter()
  compiled = prepared.fn.lower(*prepared.args).compile()
  compile_s = time.perf_counter() - start
  run = lambda: compiled(*prepared.args)
  jax.block_until_ready(run())
  seconds, (out, executed) = timed(run, args.repeats)
  executed = np.asarray(executed)
  expected = sched.delayed_schedule(pipe, num_mb, args.new_tokens)
  if not np.array_equal(executed, expected):
    raise AssertionError(f"{name}: executed schedule differs from the delayed schedule")
  png = os.path.join(out_dir, f"schedule_{name.replace(' ', '_')}.png")
  sched.draw_schedule(executed, png, title=(
      f"{name}: P={pipe} M={num_mb} T={args.new_tokens}, utilization "
      f"{sched.utilization(executed):.2f}"))
  memory, source = memory_per_device([compiled])
  return dict(variant=name, devices=pipe * tensor, pipeline=pipe, microbatches=num_mb,
              tensor=tensor, data=1, compile_s=round(compile_s, 2),
              seconds=round(seconds, 4),
              tokens_per_s=round(args.batch * args.new_tokens / seconds, 1),
              ticks=executed.shape[0],
              utilization_measured=round(sched.utilization(executed), 4),
              utilization_theory=round(sched.theoretical_utilization(
                  pipe, num_mb, args.new_tokens), 4),
              memory_per_device_kb=round(memory / 1024, 1), memory_source=source), out


def run_variants(args) -> None:
  """The plain sampler on several meshes beside the pipelined decoders, on 8 devices;
  writes variants.csv and a schedule PNG per pipelined variant."""
  args.batch = int(args.batch_sizes)
  model = init_model(tiny_config(), seed=0)
  rs = np.random.RandomState(0)
  prompt = jnp.asarray(rs.randint(1, model.config.vocab_size,
                                  (args.batch, args.prompt_len)), jnp.int32)
  lengths = rs.randint(args.prompt_len // 2, args.prompt_len + 1, args.batch)
  mask = jnp.asarray(np.arange(args.prompt_len)[None] >= (args.prompt_len - lengths)[:, None])
  n = jax.device_count()
  print(f"tiny_config ({model.config.num_params():,} params), batch {args.batch}, prompt "
        f"{args.prompt_len}, new tokens {args.new_tokens}, {n} {jax.default_backend()} "
        "devices")

  keep = lambda name: not args.variants or name in args.variants
  rows, reference = [], None
  plain = [("single", MeshShape()), ("data8", MeshShape(data=8)),
           ("tensor2", MeshShape(tensor=2))]
  for name, shape in plain:
    if shape.size <= n and keep(name):
      row, out = bench_plain(name, model, prompt, mask, args, shape)
      reference = out.output() if reference is None else reference
      rows.append(row)
  piped = [("naive P4 M1", 4, 1, 1, True), ("delayed P4 M4", 4, 4, 1, True),
           ("delayed P4 M8", 4, 8, 1, True), ("delayed P4 M8 padded", 4, 8, 1, False),
           ("naive P2 M1", 2, 1, 1, True), ("delayed P2 M2", 2, 2, 1, True),
           ("delayed P2 M4", 2, 4, 1, True), ("delayed P4xT2 M8", 4, 8, 2, True)]
  for name, pipe, num_mb, tensor, split in piped:
    if pipe * tensor > n or not keep(name):
      continue
    row, out = bench_pipeline(name, model, prompt, mask, args, pipe, num_mb, tensor,
                              split, args.out_dir)
    # Greedy/sampled results agree token for token with the plain sampler.
    row["tokens_equal_plain"] = ("" if reference is None else
                                 bool(np.array_equal(out.tokens, reference.tokens)))
    rows.append(row)

  single = next((r["tokens_per_s"] for r in rows if r["variant"] == "single"), None)
  for row in rows:  # throughput relative to the plain sampler on one device
    row["vs_single"] = round(row["tokens_per_s"] / single, 3) if single else ""
  path = show_and_write(rows, os.path.join(args.out_dir, "variants.csv"))
  print(f"wrote {path} and schedule_*.png")



def show_and_write(rows: list[dict], path: str) -> str:
  """Prints `rows` as an aligned table and writes them to the CSV `path` (a column per
  key any row has, blank where a row lacks it); returns the path."""
  columns = list(dict.fromkeys(k for row in rows for k in row))
  widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
  print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
  for row in rows:
    print("  ".join(str(row.get(c, "")).rjust(w) for c, w in zip(columns, widths)))
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
  return path

def main(argv=None) -> None:
  args = parse_args(argv)
  if args.variants is not None:
    # Before jax starts its backend: the meshes of the comparison need 8 devices.
    use_virtual_cpu_devices()
  os.makedirs(args.out_dir, exist_ok=True)
  (run_batch_sizes if args.variants is None else run_variants)(args)


if __name__ == "__main__":
  main()
