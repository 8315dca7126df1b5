"""Benchmark: PPO steps at published model shapes, against the machine's limits and the planner.

Owns one measurement: for each shape of `models/shapes.py` (`--shapes`), a random-weight
Hugging Face directory is written (`models.random_checkpoint`), loaded through
`models.hf.from_pretrained`, and `PPOSystem` runs `--steps` PPO steps (`sequential`, one
device, f32; by default each stage's plan is `StagePlan()`'s, what a library user gets:
dense attention within a block, no remat, log-probs all at once, every layer unrolled;
`--attention blockwise --remat full --logits-chunk 32 --scan-unroll 1` is the
memory-lean plan that shapes too big for those defaults need; no early EOS, so the work is
fixed). The first step compiles and is left out. Shapes too big for the machine
(`--memory-only`) are sized, not run.

Per stage (generate, infer, train) it reports seconds, FLOPs (`models/flops.py`) and the
achieved FLOP/s against the f32 matmul peak measured in the same process; for decoding the
bytes per token step (weights + KV cache) against the measured memory bandwidth (the
faster of a sum and a matrix-vector product over 256 MiB, `results.machine_limits`).
Beside each, what the stage's own matmuls reach run alone in one program: the update's
GEMM shapes against the matmul peak, the decode step's [batch, K] x [K, N] products
against the bandwidth (the backend's ceiling at that row count); and one model's optimizer
step beside AdamW alone (`bench_ppo_step.optimizer_seconds`). The step's bound is the
sum over stages of max(FLOPs / peak, bytes / bandwidth). Memory: XLA's
`memory_analysis()` of the actor's completion log-probs (forward: infer; value_and_grad:
train) and of one cached decode step, the process peak RSS, and the planner's memory model
(`planner.memory.plan_memory`). The planner's predicted step time
(`planner.search.price`, analytic cpu profile) is set beside the measured one twice: with
the profile's assumed efficiencies, and with efficiencies probed in the same run on the
stage's own matmul shapes and optimizer step (`probed_machine`; microbenchmarks, not the
stage timings, so the check stays held out).

Usage:
  python experiments/bench_real_shapes.py --shapes smollm2-135m --steps 2
  python experiments/bench_real_shapes.py --shapes smollm2-135m --layers 4 --steps 1 --page
  python experiments/bench_real_shapes.py --shapes smollm2-135m,qwen2.5-0.5b,qwen3-0.6b \
      --memory-only qwen2.5-0.5b,qwen3-0.6b --page
  python experiments/bench_real_shapes.py --shapes smollm2-135m --attention blockwise \
      --remat full --logits-chunk 32 --scan-unroll 1

Writes experiments/out/real_shapes/<shape>.jsonl (one row per shape and run) and, with
--page, docs/results/real_shapes.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

from pipe_rlhf_jax.host_devices import use_memory_lean_scheduler  # noqa: E402

# Before jax starts its backend; the planner's calibration and the main job use it too.
use_memory_lean_scheduler()

from flax import nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import bench_ppo_step, results  # noqa: E402
from pipe_rlhf_jax.generation import SamplingParams  # noqa: E402
from pipe_rlhf_jax.models import KVCache, flops, hf  # noqa: E402
from pipe_rlhf_jax.models.random_checkpoint import write_random_checkpoint  # noqa: E402
from pipe_rlhf_jax.planner import cost, hardware, memory, search, space  # noqa: E402
from pipe_rlhf_jax.stages import common  # noqa: E402
from pipe_rlhf_jax.system import (  # noqa: E402
  MeshSpec,
  Models,
  Plan,
  PPOConfig,
  PPOSystem,
  StagePlan,
  run,
)

STAGES = ("generate", "infer", "train")
OUT_DIR = os.path.join(_ROOT, "experiments", "out", "real_shapes")
MIB = 2**20


DEFAULTS = StagePlan()
# The memory-lean plan: blockwise attention everywhere, full remat in the update, the head
# and log-softmax in chunks of completion positions, a rolled layer scan; what the shapes
# too big for the defaults need (`device_check.py` runs it).
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
  forward = bench_ppo_step.gemm_shapes(cfg, batch * (prompt + gen), batch * gen)[
      :7 * cfg.num_layers + 1]
  fraction = lambda v: min(1.0, v)
  eff = cost.Efficiency(
      matmul=fraction(bench_ppo_step.shape_rate(forward, cfg.dtype) * 1e9 / peak),
      train=fraction(row["train_shapes_gflops"] * 1e9 / peak),
      decode_bw=fraction(row["decode_shapes_gbps"] * 1e9 / bw),
      optimizer_bw=fraction(7 * memory.param_bytes(cfg) / row["optimizer_s"] / bw),
      host_peak_flops=peak, hbm_bw=bw, **cost.FITTED_ELEMENTWISE,
      source="probed in this run on the stage's own matmul shapes and optimizer step")
  return cost.Machine(hardware.get(hardware_name), eff)


def runtime_for(mode: str, plans: dict[str, StagePlan]) -> Plan:
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


def devices_needed(runtime: Plan) -> int:
  """Devices `runtime_for`'s plan runs on."""
  return sum(runtime.placement) if runtime.mode == "pipe" else 1


def planner_prediction(cfg, runtime, batch, prompt, gen, machine: cost.Machine
                       ) -> dict[str, float]:
  """The planner's step time, per-stage times and peak memory of `runtime` on `machine`."""
  work = space.Workload(actor=cfg, batch_size=batch, minibatch_size=batch, epochs=1,
                        prompt_len=prompt, gen_len=gen, num_devices=devices_needed(runtime),
                        reward_model=False)
  cand = search.price(runtime, work, machine)
  pred = {"planner_step_s": cand.step_time}
  if cand.cost is not None:
    pred.update({f"planner_{s}_s": cand.cost.stage(s) for s in STAGES})
  pred["planner_memory_mib"] = max(memory.plan_memory(runtime, work).values()) / MIB
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
  """One row: `args.steps` timed PPO steps of `shape` against `limits` and the planner.

  Args:
    shape: a name of `models.shapes.SHAPES`.
    args: `layers`, `batch`, `prompt_len`, `new_tokens`, `steps`, `logits_chunk`.
    limits: `results.machine_limits()` of this process, measured in `dtype`.
    mode: the runtime mode (`runtime_for`); `pipe` needs three devices.
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
  runtime = runtime_for(mode, plans)
  devices = jax.devices()[:devices_needed(runtime)]
  if len(devices) < devices_needed(runtime):
    raise ValueError(f"mode {mode} needs {devices_needed(runtime)} devices; "
                     f"{len(jax.devices())} exist.")
  system = PPOSystem(
      Models.from_policy(policy),
      ppo=PPOConfig(steps=args.steps + 1, batch_size=batch, minibatch_size=batch, epochs=1,
                    actor_lr=1e-6, critic_lr=1e-6),
      sampling=SamplingParams(max_new_tokens=gen, temperature=1.0, eos_id=None, pad_id=0),
      runtime=runtime,
      reward_fn=lambda prompts, completions: [float(len(c)) for c in completions],
      decode=lambda ids: " ".join(str(int(i)) for i in ids), devices=devices)
  rng = np.random.default_rng(0)

  def prompts():
    index = 0
    while True:
      yield {"prompt_tokens": rng.integers(3, min(vocab, 30000), (batch, prompt)
                                           ).astype(np.int32),
             "prompt_mask": np.ones((batch, prompt), bool),
             "index": np.arange(index, index + batch)}
      index += batch

  t0 = time.perf_counter()
  metrics = run(system, prompts(), args.steps + 1).metrics
  wall = time.perf_counter() - t0
  steady = metrics[1:]
  mean = lambda key: float(np.mean([m[key] for m in steady]))
  length = prompt + gen
  critic = cfg.replace(head="value")
  work = {
      "generate": (flops.forward_flops(cfg, batch, prompt, head_positions=1)
                   + sum(flops.forward_flops(cfg, batch, 1, context=prompt + t)
                         for t in range(gen - 1))),
      "infer": (flops.forward_flops(cfg, batch, length, head_positions=gen)
                + flops.forward_flops(critic, batch, length, head_positions=gen)),
      # The model's FLOPs (forward + backward, no recompute), as MFU counts them: a remat
      # policy's extra forward is time the plan spends, not work the step needs.
      "train": (flops.train_flops(cfg, batch, length, remat="none", head_positions=gen)
                + flops.train_flops(critic, batch, length, remat="none", head_positions=gen)),
  }
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
  row["train_shapes_gflops"] = bench_ppo_step.shape_rate(
      bench_ppo_step.gemm_shapes(cfg, batch * length, batch * gen), cfg.dtype)
  # Likewise the decode step's matmuls at its row count: how fast the backend streams
  # their weights when nothing else runs.
  row["decode_shapes_gbps"] = bench_ppo_step.weight_rate(
      bench_ppo_step.decode_shapes(cfg, batch), cfg.dtype)
  # One model's optimizer step (norm, finiteness test, clipping, AdamW) beside AdamW alone.
  row.update(bench_ppo_step.optimizer_seconds(cfg))
  machine = planner_machine(limits, getattr(args, "calibration", ""), hardware_name)
  row.update(planner_prediction(cfg, runtime, batch, prompt, gen, machine))
  row["planner_efficiency"] = machine.eff.source
  row["plans"] = {s: dataclasses.asdict(p) for s, p in plans.items()}
  row["planner_step_error"] = abs(row["planner_step_s"] - step_s) / step_s
  # The same model with the machine's rates at this shape (`probed_machine`): what is
  # left of its error is work its FLOP and byte counts leave out.
  probed = probed_machine(cfg, batch, prompt, gen, row, limits, hardware_name)
  row["planner_probed_efficiency"] = {k: getattr(probed.eff, k) for k in (
      "matmul", "train", "decode_bw", "optimizer_bw")}
  row.update({k.replace("planner_", "planner_probed_"): v for k, v in planner_prediction(
      cfg, runtime, batch, prompt, gen, probed).items() if k != "planner_memory_mib"})
  row["planner_probed_step_error"] = abs(row["planner_probed_step_s"] - step_s) / step_s
  # The held-out check of the non-matmul term (`cost.ELEMENTWISE`, fitted across toy sizes
  # by fit_elementwise.py, never on these shapes): the probed prediction with it switched
  # off, beside the one above.
  row["planner_elementwise"] = {n: getattr(probed.eff, n) for n in cost.ELEMENTWISE.values()}
  off = cost.Machine(probed.hw, dataclasses.replace(
      probed.eff, **{n: 0.0 for n in cost.ELEMENTWISE.values()}))
  row["planner_probed_noterm_step_s"] = planner_prediction(
      cfg, runtime, batch, prompt, gen, off)["planner_step_s"]
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


def memory_row(shape: str, args, limits) -> dict:
  """What a shape would need, without running it: the planner's peak, the machine's usable
  memory, and XLA's peaks of the actor's stage functions, compiled on abstract parameters
  (`--memory-only`, for shapes that do not fit). Sized with blockwise attention, full
  remat and a rolled layer scan (and `--logits-chunk`), whatever the other flags: near the
  least it needs."""
  from pipe_rlhf_jax.models import shapes
  overrides = {"num_hidden_layers": args.layers} if args.layers else {}
  cfg = shapes.config(shape, dtype="float32", **overrides)
  batch, prompt, gen = args.batch, args.prompt_len, args.new_tokens
  plans = stage_plans(args.logits_chunk, LEAN["attention"], LEAN["remat"],
                      LEAN["scan_unroll"])
  runtime = runtime_for("sequential", plans)
  work = space.Workload(actor=cfg, batch_size=batch, minibatch_size=batch, epochs=1,
                        prompt_len=prompt, gen_len=gen, num_devices=1, reward_model=False)
  need = max(memory.plan_memory(runtime, work).values())
  usable = memory.capacity(hardware.get("cpu"), 1)
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  row = {"shape": shape, "layers": cfg.num_layers, "params": cfg.num_params(),
         "batch": batch, "prompt_len": prompt, "new_tokens": gen, "memory_only": True,
         "planner_memory_mib": need / MIB, "usable_mib": usable / MIB,
         "host_ram_mib": host / MIB, "fits": bool(need <= min(usable, host)),
         "planner_terms": {s: memory.stage_memory(s, runtime.stage(s),
                                                  dict(data=1, fsdp=1, tensor=1, pipe=1),
                                                  work).describe() for s in STAGES}}
  row.update({f"xla_{s}_mib": v for s, v in xla_peaks(cfg, batch, prompt, gen, plans).items()})
  return row


GOALS = (
    ("step within 2x of bound", "measured_over_bound", lambda v: v <= 2.0, "{:.2f}x"),
    ("decode >= 50% of bandwidth bound", "decode_bandwidth_fraction", lambda v: v >= 0.5,
     "{:.0%}"),
    ("update >= 50% of matmul peak", "train_peak_fraction", lambda v: v >= 0.5, "{:.0%}"),
    ("planner step-time error <= 20% (assumed efficiencies)", "planner_step_error",
     lambda v: v <= 0.2, "{:.0%}"),
    ("planner step-time error <= 20% (probed efficiencies, no non-matmul term)",
     "planner_probed_noterm_step_error", lambda v: v <= 0.2, "{:.0%}"),
    ("planner step-time error <= 20% (probed efficiencies)", "planner_probed_step_error",
     lambda v: v <= 0.2, "{:.0%}"),
    ("memory model within 25% (of peak RSS)", "memory_model_error", lambda v: v <= 0.25,
     "{:.0%}"),
)


def page_body(rows) -> str:
  lines = [__doc__.split("\nUsage:")[0].split("\n", 1)[1].strip(), ""]
  for r in rows:
    if r.get("memory_only"):
      lines += [f"## {r['shape']} ({r['layers']} layers, {r['params'] / 1e6:.0f}M params; "
                f"batch {r['batch']}, prompt {r['prompt_len']}, new tokens "
                f"{r['new_tokens']}): memory only, blockwise attention and full remat", "",
                f"Not run: the planner's memory model puts the step's peak at "
                f"{r['planner_memory_mib'] / 1024:.1f} GiB, against "
                f"{r['usable_mib'] / 1024:.1f} GiB usable of this machine's "
                f"{r['host_ram_mib'] / 1024:.1f} GiB of RAM"
                + (" (it fits)." if r["fits"] else ": it does not fit.")
                + " Its terms per stage (actor, critic and reference state, Adam moments, "
                  "activations):", ""]
      lines += [f"- {s}: {r['planner_terms'][s]}" for s in STAGES]
      lines += ["", "XLA's peak of the actor's stage functions alone (compiled on abstract "
                    "parameters): " + ", ".join(f"{s} {r[f'xla_{s}_mib']:.0f} MiB"
                                                 for s in STAGES) + ".", ""]
      continue
    lines += [f"## {r['shape']} ({r['layers']} layers, {r['params'] / 1e6:.0f}M params; "
              f"batch {r['batch']}, prompt {r['prompt_len']}, new tokens {r['new_tokens']}, "
              f"{r['steps']} timed steps)", "",
              "| stage | s | planner s | planner s, probed | GFLOP | GFLOP/s (% of peak) | "
              "bound s | XLA peak MiB |", "|---|---|---|---|---|---|---|---|"]
    for s in STAGES:
      lines.append(f"| {s} | {r[f'{s}_s']:.3f} | {r.get(f'planner_{s}_s', math.nan):.3f} | "
                   f"{r.get(f'planner_probed_{s}_s', math.nan):.3f} | "
                   f"{r[f'{s}_flops'] / 1e9:.1f} | {r[f'{s}_gflops']:.1f} "
                   f"({r[f'{s}_peak_fraction']:.0%}) | {r[f'{s}_bound_s']:.3f} | "
                   f"{r[f'xla_{s}_mib']:.0f} |")
    lines += [f"| step | {r['step_s']:.3f} | {r['planner_step_s']:.3f} | "
              f"{r.get('planner_probed_step_s', math.nan):.3f} | | | "
              f"{r['bound_s']:.3f} | |", "",
              f"Decode: {r['decode_bytes_per_token_step'] / MIB:.1f} MiB read per token step, "
              f"{r['decode_gbps']:.2f} GB/s ({r['decode_bandwidth_fraction']:.0%} of the "
              f"measured bandwidth); its matmuls alone (every layer's projections and the "
              f"head at {r['batch']} rows, one program) read their weights at "
              f"{r['decode_shapes_gbps']:.2f} GB/s "
              f"({r['decode_shapes_gbps'] / r['limits']['mem_gbps']:.0%} of the bandwidth): "
              f"the decode reaches {r['decode_gbps'] / r['decode_shapes_gbps']:.0%} of that. "
              f"Memory: peak RSS {r['peak_rss_mib']:.0f} MiB, planner "
              f"{r['planner_memory_mib']:.0f} MiB. The update's GEMM shapes alone run at "
              f"{r['train_shapes_gflops']:.1f} GFLOP/s "
              f"({r['train_shapes_gflops'] * 1e9 / (r['limits']['matmul_gflops'] * 1e9):.0%}"
              f" of the peak); the update reaches "
              f"{r['train_gflops'] / r['train_shapes_gflops']:.0%} of that. One model's "
              f"optimizer step (global norm, finiteness test, clipping, AdamW; state "
              f"donated) takes {r['optimizer_s']:.3f} s, AdamW alone "
              f"{r['adamw_s']:.3f} s.", "",
              "Plan: " + "; ".join(
                  f"{s} attention={p['attention']}, remat={p['remat']}, "
                  f"logits_chunk={p['logits_chunk']}, scan_unroll={p['scan_unroll']}"
                  for s, p in r.get("plans", {}).items())
              + f". Planner efficiencies: {r.get('planner_efficiency', 'n/a')}; probed ("
              + ", ".join(f"{k} {v:.2f}" for k, v in r.get(
                  "planner_probed_efficiency", {}).items())
              + "): the forward's and the update's matmul shapes against the matmul peak, "
                "the decode step's matmuls against the bandwidth, one model's optimizer "
                "step against the bandwidth (`probed_machine`). Both include the non-matmul "
                "term (passes per activation element: "
              + ", ".join(f"{k} {v:.1f}" for k, v in r.get("planner_elementwise", {}).items())
              + "; fitted across toy sizes by `fit_elementwise.py`, this shape held out); "
                "with it off, the probed prediction is "
              + f"{r.get('planner_probed_noterm_step_s', math.nan):.3f} s.", "",
              "| goal | measured | |", "|---|---|---|"]
    for name, key, ok, fmt in GOALS:
      if key not in r:  # a row recorded before the goal existed
        continue
      lines.append(f"| {name} | {fmt.format(r[key])} | {'met' if ok(r[key]) else 'not met'} |")
    lines.append("")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split(
      "\nUsage:")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", default="smollm2-135m")
  parser.add_argument("--layers", type=int, default=0, help="override the layer count")
  parser.add_argument("--steps", type=int, default=2, help="timed steps (after one compile step)")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt-len", type=int, default=64)
  parser.add_argument("--new-tokens", type=int, default=64)
  # Defaults: the library's (`StagePlan()`), so that the benchmark measures what a user
  # gets; `LEAN` is the memory-lean alternative.
  parser.add_argument("--logits-chunk", type=int, default=DEFAULTS.logits_chunk,
                      help=f"0: all at once; memory-lean: {LEAN['logits_chunk']}")
  parser.add_argument("--attention", default=DEFAULTS.attention,
                      help=f"every stage's attention; memory-lean: {LEAN['attention']}")
  parser.add_argument("--remat", default=DEFAULTS.remat,
                      help=f"the update's remat policy; memory-lean: {LEAN['remat']}")
  parser.add_argument("--scan-unroll", type=int, default=DEFAULTS.scan_unroll,
                      help="layers per layer-scan iteration (0: the library's choice, "
                      "every layer unrolled unless remat is set; memory-lean: "
                      f"{LEAN['scan_unroll']}, a loop)")
  parser.add_argument("--untied", action="store_true",
                      help="an LM head of its own, not tied to the embedding")
  parser.add_argument("--memory-only", default="", help="shapes (of --shapes) to size "
                      "without running: the planner's memory and XLA's compiled peaks")
  parser.add_argument("--calibration", default="",
                      help="a planner.calibrate JSON file for the planner's prediction")
  parser.add_argument("--out-dir", default=OUT_DIR)
  parser.add_argument("--page", action="store_true", help="write docs/results/real_shapes.md")
  parser.add_argument("--page-dir", default=results.RESULTS_DIR, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  os.makedirs(args.out_dir, exist_ok=True)
  limits = results.machine_limits()
  print(f"matmul peak {limits['matmul_gflops']:.1f} GFLOP/s, memory "
        f"{limits['mem_gbps']:.1f} GB/s", flush=True)
  rows = []
  for shape in args.shapes.split(","):
    row = (memory_row(shape, args, limits) if shape in args.memory_only.split(",")
           else bench_shape(shape, args, limits))
    row["limits"] = limits
    rows.append(row)
    with open(os.path.join(args.out_dir, f"{shape}.jsonl"), "a", encoding="utf-8") as f:
      f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
  if args.page:
    path = results.write_page("real_shapes", "PPO steps at real model shapes",
                              page_body(rows), limits, directory=args.page_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
