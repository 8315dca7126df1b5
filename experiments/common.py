"""Measuring helpers that more than one experiment script runs.

Owns what the benchmarks share, so that no script imports another:

- toy-size PPO steps and their matmul probes (`bench_size`, `gemm_shapes`,
  `decode_shapes`, `shape_rate`, `weight_rate`, `optimizer_seconds`), measured by
  `bench_ppo_step --sizes` and fitted on by `fit_elementwise`, at the sizes of
  `experiments.shapes.SIZES`;
- PPO steps at published model shapes against the machine's limits and the planner
  (`bench_shape`, `stage_plans`, `plan_for`, `planner_prediction`, `probed_machine`,
  `write_checkpoint`), measured by `bench_ppo_step --shapes` and `device_check`;
- config files with dotted overrides (`load_config`, `apply_overrides`, `parse_value`),
  read by `learning_curves`, `logprob_mismatch` and `rm_probe`.

Sets no XLA flag: each script sets its own (virtual CPU devices, the memory-lean
scheduler) before anything starts jax's backend, which importing this module does not.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import math
import os
import resource
import tempfile
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from experiments import results
from experiments.shapes import SIZES
from pipe_rlhf_jax.config import MeshSpec, Plan, PPOSettings, StagePlan
from pipe_rlhf_jax.generation import SamplingSettings
from pipe_rlhf_jax.models import KVCache, flops, hf, init_model, tiny_config
from pipe_rlhf_jax.models.random_checkpoint import write_random_checkpoint
from pipe_rlhf_jax.planner import cost, hardware, memory, search, space
from pipe_rlhf_jax.stages import common
from pipe_rlhf_jax.system import Models, PPOSystem, run

# ---- toy-size PPO steps and their matmul probes ------------------------------------------

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




def stage_flops(cfg, batch: int, prompt: int, gen: int) -> dict[str, float]:
  """The model FLOPs of one PPO step's stages with actor `cfg` and its critic: generate
  (the prompt's prefill, then gen - 1 decode steps), infer (actor and critic forwards over
  prompt + gen) and train (their forward + backward, no recompute, as MFU counts them: a
  remat policy's extra forward is time the plan spends, not work the step needs)."""
  length, critic = prompt + gen, cfg.replace(head="value")
  return {
      "generate": (flops.forward_flops(cfg, batch, prompt, head_positions=1)
                   + sum(flops.forward_flops(cfg, batch, 1, context=prompt + t)
                         for t in range(gen - 1))),
      "infer": (flops.forward_flops(cfg, batch, length, head_positions=gen)
                + flops.forward_flops(critic, batch, length, head_positions=gen)),
      "train": (flops.train_flops(cfg, batch, length, head_positions=gen)
                + flops.train_flops(critic, batch, length, head_positions=gen)),
  }

def random_prompts(vocab: int, batch: int, prompt: int, seed: int = 0):
  """An endless stream of prompt batches of random token ids in [3, vocab), every
  position real, with consecutive sample indices (what `system.run` reads)."""
  rng = np.random.default_rng(seed)
  index = 0
  while True:
    yield {"prompt_tokens": rng.integers(3, vocab, (batch, prompt)).astype(np.int32),
           "prompt_mask": np.ones((batch, prompt), bool),
           "index": np.arange(index, index + batch)}
    index += batch

def bench_size(size: int, steps: int, warmup: int, scan_unroll: int) -> dict:
  """One row of `bench_ppo_step --sizes`: `steps` PPO steps at `SIZES[size]` (sequential, one
  device, f32), the first `warmup` left out of the means."""
  layers, embed, heads, kv, mlp, vocab, batch, prompt, gen = SIZES[size]
  cfg = tiny_config(vocab_size=vocab, embed_dim=embed, num_layers=layers, num_heads=heads,
                    num_kv_heads=kv, head_dim=embed // heads, mlp_dim=mlp)
  devices = jax.devices()[:1]
  system = PPOSystem(
      Models.from_policy(init_model(cfg, seed=0)),
      ppo=PPOSettings(steps=steps, batch_size=batch, minibatch_size=batch, epochs=1,
                    actor_lr=1e-5, critic_lr=1e-5),
      sampling=SamplingSettings(max_new_tokens=gen, temperature=1.0, eos_id=None, pad_id=0),
      plan=Plan(mode="sequential", mesh=MeshSpec(data=1),
                            **{stage: StagePlan(scan_unroll=scan_unroll or layers)
                               for stage in ("generate", "infer", "train")}),
      reward_fn=lambda prompts, completions: [float(len(c)) for c in completions],
      decode=lambda ids: " ".join(str(int(i)) for i in ids), devices=devices)
  t0 = time.perf_counter()
  metrics = run(system, random_prompts(vocab, batch, prompt), steps).metrics
  wall = time.perf_counter() - t0
  steady = metrics[warmup:]
  mean = lambda key: float(np.mean([m[key] for m in steady]))
  length = prompt + gen
  actor = cfg
  work = stage_flops(cfg, batch, prompt, gen)
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

# ---- PPO steps at published model shapes -------------------------------------------------

STAGES = ("generate", "infer", "train")
MIB = 2**20


DEFAULTS = StagePlan()
# The memory-lean plan: blockwise attention everywhere, full remat in the update, the head
# and log-softmax in chunks of completion positions, a rolled layer scan; what the shapes
# too big for the defaults need (`device_check` runs it).
LEAN = dict(attention="blockwise", remat="full", logits_chunk=32, scan_unroll=1)


def stage_plans(logits_chunk: int = DEFAULTS.logits_chunk,
                attention: str = DEFAULTS.attention, remat: str = DEFAULTS.remat,
                scan_unroll: int = DEFAULTS.scan_unroll) -> dict[str, StagePlan]:
  """The execution of real shapes; by default the library's (`StagePlan()`); `remat`
  applies to the update, `logits_chunk` to inference and the update."""
  common_ = dict(attention=attention, scan_unroll=scan_unroll)
  return {"generate": StagePlan(**common_),
          "infer": StagePlan(logits_chunk=logits_chunk, **common_),
          "train": StagePlan(remat=remat, logits_chunk=logits_chunk, **common_)}


def xla_peaks(cfg, batch: int, prompt: int, gen: int, plans) -> dict[str, float]:
  """Peak MiB (arguments + outputs + temporaries - aliased) of the actor's stage functions,
  compiled on abstract parameters (nothing runs)."""
  def peak(compiled):
    m = compiled.memory_analysis()
    if m is None:
      return math.nan
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - getattr(m, "alias_size_in_bytes", 0)) / MIB
  length = prompt + gen
  out = {}
  for stage in ("infer", "train"):
    c = cfg.replace(**plans[stage].execution())
    graphdef, params = nnx.split(nnx.eval_shape(lambda c=c: __import__(
        "pipe_rlhf_jax.models", fromlist=["init_model"]).init_model(c)))
    ids = jax.ShapeDtypeStruct((batch, prompt), jnp.int32)
    pmask = jax.ShapeDtypeStruct((batch, prompt), jnp.bool_)
    tgt = jax.ShapeDtypeStruct((batch, gen), jnp.int32)
    tmask = jax.ShapeDtypeStruct((batch, gen), jnp.bool_)
    fn = lambda p, a, b, t, m, g=graphdef: common.completion_logprobs(g, p, a, b, t, m)
    if stage == "train":
      fwd = fn
      fn = jax.value_and_grad(lambda *a: -jnp.mean(fwd(*a)))
    out[stage] = peak(jax.jit(fn).lower(params, ids, pmask, tgt, tmask).compile())
  c = cfg.replace(**plans["generate"].execution())
  from pipe_rlhf_jax.models import init_model
  graphdef, params = nnx.split(nnx.eval_shape(lambda: init_model(c)))
  cache = jax.eval_shape(lambda: KVCache.zeros(c, batch, length))

  def decode(params, cache, token, key_mask):
    positions = jnp.full((batch, 1), length - 1, jnp.int32)
    return nnx.merge(graphdef, params).forward_cached(token, positions, key_mask, cache,
                                                      length - 1)
  out["generate"] = peak(jax.jit(decode).lower(
      params, cache, jax.ShapeDtypeStruct((batch, 1), jnp.int32),
      jax.ShapeDtypeStruct((batch, length), jnp.bool_)).compile())
  return out


def planner_machine(limits, calibration: str = "", hardware_name: str = "cpu"
                    ) -> cost.Machine:
  """The `hardware_name` profile with a `planner.calibrate` file's efficiencies (fitted on
  the tiny model, so real shapes are held out), or the default efficiencies; either way the
  bandwidth (and on the cpu the peak) is the one measured in this run unless the file has
  its own."""
  if calibration:
    eff = cost.Efficiency.load(calibration)
    eff = dataclasses.replace(eff, source=f"calibration {calibration}")
  else:
    eff = cost.Efficiency(source=f"{hardware_name} profile, assumed efficiencies")
  eff = dataclasses.replace(eff, host_peak_flops=eff.host_peak_flops
                            or limits["matmul_gflops"] * 1e9,
                            hbm_bw=eff.hbm_bw or limits["mem_gbps"] * 1e9)
  return cost.Machine(hardware.get(hardware_name), eff)


def probed_machine(cfg, batch: int, prompt: int, gen: int, row: dict, limits,
                   hardware_name: str = "cpu") -> cost.Machine:
  """The `hardware_name` profile with efficiencies probed in this run on the stage's own
  work, not on its timings: the forward's and the update's matmul shapes against the
  matmul peak, the decode step's matmuls against the bandwidth, and one model's optimizer
  step against the bandwidth as the cost model prices Adam (7 parameter-sized reads and
  writes). `row` holds the update's, the decode's and the optimizer's probes
  (`bench_shape`); the forward's is run here."""
  peak, bw = limits["matmul_gflops"] * 1e9, limits["mem_gbps"] * 1e9
  forward = gemm_shapes(cfg, batch * (prompt + gen), batch * gen)[
      :7 * cfg.num_layers + 1]
  fraction = lambda v: min(1.0, v)
  eff = cost.Efficiency(
      matmul=fraction(shape_rate(forward, cfg.dtype) * 1e9 / peak),
      train=fraction(row["train_shapes_gflops"] * 1e9 / peak),
      decode_bw=fraction(row["decode_shapes_gbps"] * 1e9 / bw),
      optimizer_bw=fraction(7 * memory.param_bytes(cfg) / row["optimizer_s"] / bw),
      host_peak_flops=peak, hbm_bw=bw, **cost.FITTED_ELEMENTWISE,
      source="probed in this run on the stage's own matmul shapes and optimizer step")
  return cost.Machine(hardware.get(hardware_name), eff)


def plan_for(mode: str, plans: dict[str, StagePlan]) -> Plan:
  """The plan of `mode` with the stage plans `plans`, on the fewest devices it allows.

  `sequential` and `per_stage` run on one device (one mesh, or each stage's own mesh over
  the same device); `pipe` gives each stage a block of its own, so it needs three.
  """
  if mode == "sequential":
    return Plan(mode="sequential", mesh=MeshSpec(data=1), **plans)
  if mode == "per_stage":
    return Plan(mode="per_stage", **plans)
  if mode == "pipe":
    return Plan(mode="pipe", placement=(1, 1, 1), **plans)
  raise ValueError(f"mode={mode!r}; choose sequential, per_stage or pipe.")


def devices_needed(plan: Plan) -> int:
  """Devices `plan_for`'s plan runs on."""
  return sum(plan.placement) if plan.mode == "pipe" else 1


def planner_prediction(cfg, plan, batch, prompt, gen, machine: cost.Machine
                       ) -> dict[str, float]:
  """The planner's step time, per-stage times and peak memory of `plan` on `machine`."""
  work = space.Workload(actor=cfg, batch_size=batch, minibatch_size=batch, epochs=1,
                        prompt_len=prompt, gen_len=gen, num_devices=devices_needed(plan),
                        reward_model=False)
  cand = search.price(plan, work, machine)
  pred = {"planner_step_s": cand.step_time}
  if cand.cost is not None:
    pred.update({f"planner_{s}_s": cand.cost.stage(s) for s in STAGES})
  pred["planner_memory_mib"] = max(memory.plan_memory(plan, work).values()) / MIB
  return pred


def write_checkpoint(shape: str, directory: str, layers: int = 0, dtype: str = "float32",
                     untied: bool = False) -> None:
  """A random-weight Hugging Face directory of `shape` (`layers` > 0 overrides the layer
  count; `untied` gives it an LM head of its own), tensors stored in `dtype`."""
  overrides = {"num_hidden_layers": layers} if layers else {}
  if untied:
    overrides["tie_word_embeddings"] = False
  write_random_checkpoint(shape, directory, seed=0, dtype=dtype, overrides=overrides,
                          overwrite=True)


def bench_shape(shape: str, args, limits, mode: str = "sequential", dtype: str = "float32",
                hardware_name: str = "cpu", checkpoint: str | None = None) -> dict:
  """One row: `args.steps` timed PPO steps of `shape` against `limits` and the planner,
  after `args.warmup` steps (1 where `args` has none: the compile step) left out.

  Args:
    shape: a name of `models.shapes.SHAPES`.
    args: `layers`, `batch`, `prompt_len`, `new_tokens`, `steps`, `logits_chunk`; optionally
      `warmup`, `attention`, `remat`, `scan_unroll`, `untied`, `calibration`.
    limits: `results.machine_limits()` of this process, measured in `dtype`.
    mode: the mode (`plan_for`); `pipe` needs three devices.
    dtype: the models' compute and parameter dtype.
    hardware_name: the planner's hardware profile for the prediction.
    checkpoint: a directory `write_checkpoint` wrote for this shape, layers and dtype;
      None writes one to a temporary directory.
  """
  batch, prompt, gen = args.batch, args.prompt_len, args.new_tokens
  if checkpoint is None:
    with tempfile.TemporaryDirectory() as tmp:
      write_checkpoint(shape, tmp, args.layers, dtype, getattr(args, "untied", False))
      policy = hf.from_pretrained(tmp, dtype=dtype)
  else:
    policy = hf.from_pretrained(checkpoint, dtype=dtype)
  cfg = policy.config
  vocab = cfg.vocab_size
  plans = stage_plans(args.logits_chunk, getattr(args, "attention", DEFAULTS.attention),
                      getattr(args, "remat", DEFAULTS.remat),
                      getattr(args, "scan_unroll", DEFAULTS.scan_unroll))
  plan = plan_for(mode, plans)
  warmup = getattr(args, "warmup", 1)
  devices = jax.devices()[:devices_needed(plan)]
  if len(devices) < devices_needed(plan):
    raise ValueError(f"mode {mode} needs {devices_needed(plan)} devices; "
                     f"{len(jax.devices())} exist.")
  system = PPOSystem(
      Models.from_policy(policy),
      ppo=PPOSettings(steps=args.steps + warmup, batch_size=batch, minibatch_size=batch,
                    epochs=1, actor_lr=1e-6, critic_lr=1e-6),
      sampling=SamplingSettings(max_new_tokens=gen, temperature=1.0, eos_id=None, pad_id=0),
      plan=plan,
      reward_fn=lambda prompts, completions: [float(len(c)) for c in completions],
      decode=lambda ids: " ".join(str(int(i)) for i in ids), devices=devices)
  t0 = time.perf_counter()
  metrics = run(system, random_prompts(min(vocab, 30000), batch, prompt),
                args.steps + warmup).metrics
  wall = time.perf_counter() - t0
  steady = metrics[warmup:]
  mean = lambda key: float(np.mean([m[key] for m in steady]))
  work = stage_flops(cfg, batch, prompt, gen)
  decode_bytes = sum(flops.decode_step_bytes(cfg, batch, prompt + t) for t in range(gen))
  peak, bw = limits["matmul_gflops"] * 1e9, limits["mem_gbps"] * 1e9
  times = {s: mean(f"time/{s}_s") for s in STAGES}
  step_s = mean("time/step_s")
  bound = {s: work[s] / peak for s in STAGES}
  bound["generate"] = max(bound["generate"], decode_bytes / bw)
  row = {"shape": shape, "layers": cfg.num_layers, "params": cfg.num_params(),
         "batch": batch, "prompt_len": prompt, "new_tokens": gen, "steps": args.steps,
         "wall_s": wall, "step_s": step_s, "bound_s": sum(bound.values()),
         "decode_bytes_per_token_step": decode_bytes / gen,
         "decode_gbps": decode_bytes / times["generate"] / 1e9,
         "decode_bandwidth_fraction": decode_bytes / times["generate"] / bw}
  row["measured_over_bound"] = step_s / row["bound_s"]
  for s in STAGES:
    row[f"{s}_s"] = times[s]
    row[f"{s}_flops"] = work[s]
    row[f"{s}_gflops"] = work[s] / times[s] / 1e9
    row[f"{s}_peak_fraction"] = work[s] / times[s] / peak
    row[f"{s}_bound_s"] = bound[s]
  row.update({f"xla_{s}_mib": v for s, v in xla_peaks(cfg, batch, prompt, gen, plans).items()})
  row["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  # What the update's matmuls reach alone (every projection and the head, forward and
  # backward, one program): how much of its gap to the peak is the shapes themselves.
  row["train_shapes_gflops"] = shape_rate(
      gemm_shapes(cfg, batch * (prompt + gen), batch * gen), cfg.dtype)
  # Likewise the decode step's matmuls at its row count: how fast the backend streams
  # their weights when nothing else runs.
  row["decode_shapes_gbps"] = weight_rate(
      decode_shapes(cfg, batch), cfg.dtype)
  # One model's optimizer step (norm, finiteness test, clipping, AdamW) beside AdamW alone.
  row.update(optimizer_seconds(cfg))
  machine = planner_machine(limits, getattr(args, "calibration", ""), hardware_name)
  row.update(planner_prediction(cfg, plan, batch, prompt, gen, machine))
  row["planner_efficiency"] = machine.eff.source
  row["plans"] = {s: dataclasses.asdict(p) for s, p in plans.items()}
  row["planner_step_error"] = abs(row["planner_step_s"] - step_s) / step_s
  # The same model with the machine's rates at this shape (`probed_machine`): what is
  # left of its error is work its FLOP and byte counts leave out.
  probed = probed_machine(cfg, batch, prompt, gen, row, limits, hardware_name)
  row["planner_probed_efficiency"] = {k: getattr(probed.eff, k) for k in (
      "matmul", "train", "decode_bw", "optimizer_bw")}
  row.update({k.replace("planner_", "planner_probed_"): v for k, v in planner_prediction(
      cfg, plan, batch, prompt, gen, probed).items() if k != "planner_memory_mib"})
  row["planner_probed_step_error"] = abs(row["planner_probed_step_s"] - step_s) / step_s
  # The held-out check of the non-matmul term (`cost.ELEMENTWISE`, fitted across toy sizes
  # by fit_elementwise, never on these shapes): the probed prediction with it switched
  # off, beside the one above.
  row["planner_elementwise"] = {n: getattr(probed.eff, n) for n in cost.ELEMENTWISE.values()}
  off = cost.Machine(probed.hw, dataclasses.replace(
      probed.eff, **{n: 0.0 for n in cost.ELEMENTWISE.values()}))
  row["planner_probed_noterm_step_s"] = planner_prediction(
      cfg, plan, batch, prompt, gen, off)["planner_step_s"]
  row["planner_probed_noterm_step_error"] = abs(
      row["planner_probed_noterm_step_s"] - step_s) / step_s
  print(f"{shape}: measured step {step_s:.3f} s; planner, probed efficiencies: "
        f"{row['planner_probed_noterm_step_s']:.3f} s without the non-matmul term "
        f"({row['planner_probed_noterm_step_error']:.0%}), "
        f"{row['planner_probed_step_s']:.3f} s with it "
        f"({row['planner_probed_step_error']:.0%})", flush=True)
  # The planner's peak is of all stages' state together (params, Adam, cache); what the
  # process held at its peak is the measured counterpart.
  row["memory_model_error"] = abs(row["planner_memory_mib"] - row["peak_rss_mib"]) / (
      row["peak_rss_mib"])
  return row

# ---- config files with dotted overrides --------------------------------------------------

def parse_value(text: str):
  """A --set value: a Python literal (1e-3, 4, True, 'x', {...}) or else a plain string."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def apply_overrides(config, overrides: dict) -> None:
  """Sets dotted config paths, naming the path when it does not exist."""
  for path, value in overrides.items():
    node = config
    for part in path.split(".")[:-1]:
      if part not in node:
        raise ValueError(f"--set {path}: the config has no field {part!r} on that path.")
      node = node[part]
    leaf = path.split(".")[-1]
    if leaf not in node:
      raise ValueError(f"--set {path}: the config has no field {leaf!r}.")
    if isinstance(node[leaf], float) and isinstance(value, int):
      value = float(value)
    node[leaf] = value


def config_module(spec: str):
  """The config module of `path/to/config.py[:variant]`."""
  path = spec.partition(":")[0]
  module_spec = importlib.util.spec_from_file_location("lc_config", path)
  if module_spec is None or not os.path.isfile(path):
    raise ValueError(f"--config {spec!r}: no config module at {path!r}.")
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


def load_config(spec: str):
  """`path/to/config.py[:variant]` -> its `get_config(variant)`."""
  return config_module(spec).get_config(spec.partition(":")[2])
