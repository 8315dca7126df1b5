"""Benchmark: delayed inter-batch pipelined generation vs naive pipeline, tensor, data.

Owns one comparison on 8 (virtual CPU, unless a real accelerator is present) devices,
same model (the embedded tiny_config) and same prompt batch for every variant:
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
no `memory_stats`, so memory is then XLA's
compiled memory analysis (arguments + outputs + temporaries - aliased, per device),
which the CSV marks as `xla_estimate`.

On virtual CPU devices all "devices" share the host's cores, so wall-clock speedups
from pipelining are not expected there; utilisation and memory are the meaningful
columns. Writes a CSV and one schedule PNG per pipelined variant under --out-dir
(default `experiments/out/bench_pipeline_generate/`, git-ignored, wherever the script
is started from).

Usage:
  python -m experiments.bench_pipeline_generate
  python -m experiments.bench_pipeline_generate --variants "single,delayed P4 M4"
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from pipe_rlhf_jax.host_devices import use_virtual_cpu_devices  # noqa: E402

use_virtual_cpu_devices()
DEFAULT_OUT_DIR = os.path.join(REPO, "experiments", "out", "bench_pipeline_generate")

from flax import nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pipe_rlhf_jax.generation import pipelined, sampler  # noqa: E402
from pipe_rlhf_jax.generation import schedule as sched  # noqa: E402
from pipe_rlhf_jax.models.config import tiny_config  # noqa: E402
from pipe_rlhf_jax.models.transformer import init_model, param_axes  # noqa: E402
from pipe_rlhf_jax.parallel.logical import DEFAULT_RULES, axis_rules, tree_shardings  # noqa: E402
from pipe_rlhf_jax.parallel.mesh import MeshShape, make_mesh  # noqa: E402


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--prompt-len", type=int, default=16)
  parser.add_argument("--new-tokens", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--temperature", type=float, default=1.0)
  parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
  parser.add_argument("--variants", default="",
                      help="comma-separated variant names to run (default: all); the "
                      "first plain variant run is the token reference")
  return parser.parse_args(argv)


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
  params = sampler.SamplingParams(max_new_tokens=args.new_tokens,
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
  return dict(variant=name, devices=shape.size, pipe=1, microbatches=1,
              tensor=shape.tensor, data=shape.data, compile_s=round(compile_s, 2),
              seconds=round(seconds, 4),
              tokens_per_s=round(args.batch * args.new_tokens / seconds, 1),
              ticks="", utilization_measured="", utilization_theory="",
              memory_per_device_kb=round(memory / 1024, 1), memory_source=source), final


def bench_pipeline(name, model, prompt, mask, args, pipe, num_mb, tensor=1,
                   split=True, out_dir="."):
  mesh = make_mesh(MeshShape(pipe=pipe, tensor=tensor), jax.devices()[:pipe * tensor])
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
  return dict(variant=name, devices=pipe * tensor, pipe=pipe, microbatches=num_mb,
              tensor=tensor, data=1, compile_s=round(compile_s, 2),
              seconds=round(seconds, 4),
              tokens_per_s=round(args.batch * args.new_tokens / seconds, 1),
              ticks=executed.shape[0],
              utilization_measured=round(sched.utilization(executed), 4),
              utilization_theory=round(sched.theoretical_utilization(
                  pipe, num_mb, args.new_tokens), 4),
              memory_per_device_kb=round(memory / 1024, 1), memory_source=source), out


def main(argv=None):
  args = parse_args(argv)
  os.makedirs(args.out_dir, exist_ok=True)
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

  wanted = {v.strip() for v in args.variants.split(",") if v.strip()}
  keep = lambda name: not wanted or name in wanted
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
  columns = list(dict.fromkeys(k for row in rows for k in row))
  widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
  print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
  for row in rows:
    print("  ".join(str(row.get(c, "")).rjust(w) for c, w in zip(columns, widths)))
  path = os.path.join(args.out_dir, "bench_pipeline_generate.csv")
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
  print(f"wrote {path} and schedule_*.png")


if __name__ == "__main__":
  main()
