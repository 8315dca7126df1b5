"""Calibration: time real pieces on the current backend and fit the cost model's constants.

  python -m pipe_rlhf_jax.planner.calibrate --out calibration.json [--config=configs/quickstart.py]

Measures (median of repeats, after a compile-and-warm-up call):
  matmul        f32 [n, n] @ [n, n] on one device, n in {256, 512, 1024}: the device peak;
                and the same batched over all local devices (one per device): the host's
                (shared hardware: how much more than one device all of them reach).
  bandwidth     the faster of two single reads of 128 MiB of f32 on one device, a sum and
                a matrix-vector product (`read_bandwidth`).
  forward       the config's model, forward to the last hidden state + LM head, over a few
                (batch, length) points; forward+backward (value_and_grad) likewise.
  decode        K = 16 cached decode steps inside one jitted `lax.fori_loop` (as the
                sampler runs them) over a few (batch, cache slots) points.
  all-gather    16 f32 buffers sharded over 2, 4 and all local devices gathered to every
                device in one program, against one buffer alone, over a few sizes.
  dispatch      a trivial jitted call.
  concurrency   k copies of the forward+backward, one per device, run at once (k = 1, 2,
                all devices).
  split         the same forward / forward+backward / decode steps with the batch split
                over all local devices (same FLOPs, one program per device).
  optimizer     the Adam update (optax.adam, update + apply) of the model's parameters on
                one device.
  stages        the REAL stage calls, as the system makes them (`PPOSystem.generate`,
                `.infer`, `.train`: sampler or pipelined decoder, reference + critic
                passes + rule reward + experience, the whole PPO update with the
                critic and both optimizers), on calibration workloads of their own
                (`STAGE_POINTS`: 1 device, and 2, 4 and all devices with data, fsdp,
                tensor and pipeline meshes), median of repeats after a compile call.
Fits (each printed and saved with how it was obtained):
  device_peak_flops, host_peak_flops   best matmul FLOP/s (one device / all devices)
  hbm_bw                               bandwidth bytes/s (the read probe)
  matmul, call_overhead_s              forward time = c + FLOPs / (device peak x matmul)
                                       (least squares; c is the per-call overhead)
  train                                forward+backward time = c + FLOPs / (peak x train)
  tick_overhead_s, decode_bw           decode step = tick + bytes / (hbm_bw x decode_bw)
                                       (least squares over the decode points)
  link_latency, link_bw                all-gather time = alpha + V (k-1)/k / W ((k-1)
                                       alpha where `Hardware.serial_collectives`)
  host_concurrency                     best k x t(1 copy) / t(k copies at once)
  forward/train/tick_device_overhead_s (t(split over k) - t(one device)) / (k - 1), per
                                       call (forward, train) or per decode step (tick)
                                       (replaced by the stage fits below when measured)
  optimizer_bw                         Adam bytes (7 x parameters) / (seconds - dispatch)
                                       / hbm_bw
  reshard_array_s, reshard_bw          the stage points' own moves (weight sync, rollout
                                       and experience in): seconds = arrays x a + bytes x
                                       destination replicas / W (the stage samples are
                                       timed without their batch's move)
  {stage}_elementwise                  not fitted here (one model's points cannot tell it
                                       from the scale): the default, fitted across model
                                       sizes (`fit_elementwise`), carried in the file and
                                       priced in the stage fits below
  per stage (`cost.STAGE_CONSTANTS`)   the stage's seconds = scale x roofline + per call +
                                       per unit x units + per device unit x units x
                                       (devices - 1) + per exchange x the collectives'
                                       exchanges + (collectives, dispatch, Adam bytes: the
                                       analytic terms), the terms from `cost.stage_terms`
                                       with the constants above; non-negative least squares
                                       on relative residuals over the stage samples
The cost model loads the file (`cost.Efficiency.load`, `plan --calibration=FILE`).
"""

import argparse
from concurrent.futures import ThreadPoolExecutor
import dataclasses
import importlib.util
import itertools
import json
import statistics
import sys
import time

# Importing jax starts no backend (`jax.devices()` does), so `main` still sets the CPU
# device count and scheduler flags before anything runs.
from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ml_collections import config_flags  # noqa: F401 (experiment configs import it)
import numpy as np
import optax

from pipe_rlhf_jax.config import MeshSpec, Plan, PPOSettings, StagePlan
from pipe_rlhf_jax.config.experiment import ModelSettings
from pipe_rlhf_jax.generation.sampler import SamplingSettings
from pipe_rlhf_jax.host_devices import use_memory_lean_scheduler, use_virtual_cpu_devices
from pipe_rlhf_jax.models import flops
from pipe_rlhf_jax.models.config import TransformerConfig
from pipe_rlhf_jax.models.load import load_tokenizer
from pipe_rlhf_jax.models.transformer import KVCache, init_model
from pipe_rlhf_jax.planner import composition, cost, hardware, space
from pipe_rlhf_jax.planner.auto import detect_hardware
from pipe_rlhf_jax.planner.memory import param_bytes
from pipe_rlhf_jax.stages.common import MeshMismatch
from pipe_rlhf_jax.system.system import Models, PPOSystem


def timeit(fn, *args, repeats: int = 5) -> float:
  """Median seconds of `fn(*args)` (blocked), after one warm-up (compile) call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def read_bandwidth(device, mib: int, timer=timeit) -> tuple[int, float]:
  """(bytes, seconds) of the faster of two single reads of `mib` MiB of f32 on `device`:
  a sum, and a product of the same bytes as a [rows, 4096] matrix with a vector.

  Both are one pass over memory, and backends parallelise them differently: on a 2-core
  AMD EPYC with AVX-512, XLA:CPU's sum read 29-30 GB/s and the product 35-46 GB/s over
  256 MiB, while an elementwise `2 x + 1` (read + write) moved 7 GB/s. A decode step's
  weight reads are matrix products; read against the slowest probe, they would seem
  close to the memory when they are not.
  """
  width = 4096
  rows = max(1, mib * 2 ** 20 // 4 // width)
  matrix = jax.device_put(jnp.ones((rows, width), jnp.float32), device)  # [rows, width]
  vector = jax.device_put(jnp.ones((width,), jnp.float32), device)
  seconds = min(timer(jax.jit(jnp.sum), matrix),
                timer(jax.jit(lambda m, v: m @ v), matrix, vector))
  return 4 * rows * width, seconds


def fit_line(xs, ys) -> tuple[float, float]:
  """Least-squares (intercept, slope) of y = a + b x; the intercept is clipped at 0."""
  n = len(xs)
  mx, my = sum(xs) / n, sum(ys) / n
  sxx = sum((x - mx) ** 2 for x in xs)
  slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
  intercept = my - slope * mx
  if intercept < 0:  # a negative fixed cost is not physical: refit through the origin
    slope = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    intercept = 0.0
  return intercept, slope


def measure(cfg, quick: bool = False, stages: bool = True) -> dict:
  """Raw samples: lists of dicts with the sizes, analytic work and median seconds."""
  devices = jax.devices()
  dev0 = devices[0]
  out = {"backend": jax.default_backend(), "devices": len(devices),
         "device_kind": dev0.device_kind, "model": dataclasses.asdict(cfg)}
  if out["backend"] == "cpu":
    out["hardware"] = "cpu"
  else:
    out["hardware"] = detect_hardware(devices).name
  out["matmul"] = measure_matmul(devices, (256, 512) if quick else (256, 512, 1024))
  read_bytes, seconds = read_bandwidth(dev0, 32 if quick else 128)
  out["bandwidth"] = {"bytes": read_bytes, "seconds": seconds}
  trivial = jax.device_put(jnp.ones((), jnp.float32), dev0)
  out["dispatch"] = {"seconds": timeit(jax.jit(lambda s: s + 1), trivial, repeats=50)}

  graphdef, params = nnx.split(init_model(cfg))
  params = jax.device_put(params, dev0)
  points = [(8, 24), (32, 24), (64, 24), (64, 48)] if not quick else [(8, 24), (64, 24)]
  out["forward"], out["train"] = measure_forward(cfg, graphdef, params, points, dev0)
  middle = points[len(points) // 2]
  out["concurrency"] = measure_concurrency(graphdef, params, middle, devices)
  out["split"] = measure_split(graphdef, params, middle, devices, out)
  decode_points = ([(8, 32), (64, 32), (64, 128), (256, 128)] if not quick
                   else [(8, 32), (64, 128)])
  decode, split = measure_decode(cfg, graphdef, params, decode_points, devices)
  out["decode"] = decode
  out["split"] += split
  out["optimizer"] = measure_optimizer(cfg, params, dev0)
  out["all_gather"] = measure_all_gathers(
      devices, (2 ** 6, 2 ** 14) if quick else (2 ** 6, 2 ** 12, 2 ** 14, 2 ** 16))
  if stages:
    out["stages"] = measure_stages(cfg, QUICK_STAGE_POINTS if quick else STAGE_POINTS)
  return out


def measure_matmul(devices, sizes) -> list[dict]:
  """f32 [n, n] @ [n, n] on one device, then one matmul per device at once."""
  out = []
  mesh = jax.sharding.Mesh(np.array(devices), ("d",))
  for n in sizes:
    a = jax.device_put(jnp.ones((n, n), jnp.float32), devices[0])
    t1 = timeit(jax.jit(lambda a: a @ a), a)
    batch = jax.device_put(jnp.ones((len(devices), n, n), jnp.float32),
                           NamedSharding(mesh, P("d")))
    ta = timeit(jax.jit(lambda b: jnp.einsum("bij,bjk->bik", b, b)), batch)
    out.append({"n": n, "flops": 2 * n ** 3, "seconds_one": t1, "seconds_all": ta})
  return out


def _forward_fn(graphdef):
  """The model's forward to the last hidden state and the LM head, summed (a scalar)."""
  def forward(params, tokens):
    model = nnx.merge(graphdef, params)
    return model.head(model.hidden(tokens)).sum()
  return forward


def measure_forward(cfg, graphdef, params, points, device) -> tuple[list[dict], list[dict]]:
  """Forward and forward+backward seconds at each (batch, length) point, on one device."""
  forward = _forward_fn(graphdef)
  fwd, train = [], []
  for b, length in points:
    tokens = jax.device_put(jnp.ones((b, length), jnp.int32), device)
    fwd.append({"batch": b, "length": length, "seconds": timeit(jax.jit(forward), params,
                                                                  tokens),
                "flops": flops.forward_flops(cfg, b, length)})
    train.append({"batch": b, "length": length,
                  "seconds": timeit(jax.jit(jax.value_and_grad(forward)), params, tokens),
                  "flops": flops.train_flops(cfg, b, length)})
  return fwd, train


def measure_concurrency(graphdef, params, point, devices) -> list[dict]:
  """k copies of the forward+backward, one per device, run at once (threads)."""
  b, length = point
  step = jax.jit(jax.value_and_grad(_forward_fn(graphdef)))
  out = []
  for k in sorted({1, 2, len(devices)}):
    args = [(jax.device_put(params, d), jax.device_put(jnp.ones((b, length), jnp.int32), d))
            for d in devices[:k]]
    with ThreadPoolExecutor(k) as pool:
      def all_at_once():
        return list(pool.map(lambda a: jax.block_until_ready(step(*a)), args))
      all_at_once()
      times = []
      for _ in range(3):
        start = time.perf_counter()
        all_at_once()
        times.append(time.perf_counter() - start)
    out.append({"copies": k, "seconds": statistics.median(times)})
  return out


def measure_split(graphdef, params, point, devices, samples: dict) -> list[dict]:
  """The same forward / forward+backward with the batch split over all local devices
  (params replicated): the same FLOPs, run as one program per device, against the
  one-device seconds already in `samples`."""
  b, length = point
  k = len(devices)
  if k < 2 or b % k:
    return []
  mesh = jax.sharding.Mesh(np.array(devices), ("d",))
  split_params = jax.device_put(params, NamedSharding(mesh, P()))
  split_tokens = jax.device_put(jnp.ones((b, length), jnp.int32), NamedSharding(mesh, P("d")))
  forward = _forward_fn(graphdef)
  out = []
  for kind, fn in (("forward", jax.jit(forward)),
                   ("train", jax.jit(jax.value_and_grad(forward)))):
    one = next(s["seconds"] for s in samples[kind] if (s["batch"], s["length"]) == point)
    out.append({"kind": kind, "devices": k, "seconds": timeit(fn, split_params, split_tokens),
                "seconds_one": one})
  return out


def measure_decode(cfg, graphdef, params, points, devices, steps: int = 16,
                   split_point=(64, 128)) -> tuple[list[dict], list[dict]]:
  """Seconds per cached decode step, `steps` of them in one `fori_loop` (as the sampler
  runs them), at each (batch, cache slots) point; and at `split_point` the same steps
  with the batch split over all devices (what each extra device's program adds to a
  decode step or pipeline tick on a shared host)."""
  dev0, k = devices[0], len(devices)
  mesh = jax.sharding.Mesh(np.array(devices), ("d",))
  out, split = [], []
  for b, slots in points:
    cache = jax.device_put(KVCache.zeros(cfg, b, slots), dev0)
    mask = jax.device_put(jnp.ones((b, slots), bool), dev0)

    def run(params, cache, mask, b=b, slots=slots):
      model = nnx.merge(graphdef, params)

      def body(i, carry):
        cache, acc = carry
        tok = jnp.full((b, 1), 1, jnp.int32) + (acc > 1e30).astype(jnp.int32)
        pos = jnp.full((b, 1), slots - steps, jnp.int32) + i
        logits, cache = model.forward_cached(tok, pos, mask, cache, slots - steps + i)
        return cache, acc + logits[:, -1, 0].sum()
      return jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros((), jnp.float32)))[1]

    t = timeit(jax.jit(run), params, cache, mask) / steps
    # Every step attends over all `slots` (unused ones masked), as the cost model prices.
    out.append({"batch": b, "slots": slots, "seconds": t,
                "bytes": flops.decode_step_bytes(cfg, b, slots),
                "flops": flops.forward_flops(cfg, b, 1, context=slots)})
    if k > 1 and b % k == 0 and (b, slots) == tuple(split_point):
      cache_split = NamedSharding(mesh, P(None, "d"))  # [layers, batch, kv, slots, hd]
      t_split = timeit(jax.jit(run), jax.device_put(params, NamedSharding(mesh, P())),
                       jax.device_put(cache, cache_split),
                       jax.device_put(mask, NamedSharding(mesh, P("d")))) / steps
      split.append({"kind": "tick", "devices": k, "seconds": t_split, "seconds_one": t})
  return out, split


def measure_optimizer(cfg, params, device) -> dict:
  """The Adam update alone (update + apply), what every minibatch step pays per model."""
  tx = optax.adam(1e-4)
  opt_state = jax.device_put(tx.init(params), device)

  def adam(params, opt_state):
    updates, opt_state = tx.update(params, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return {"bytes": 7 * param_bytes(cfg),
          "seconds": timeit(jax.jit(adam), params, opt_state, repeats=10)}


def measure_all_gathers(devices, per_device_sizes, count: int = 16) -> list[dict]:
  """Seconds per all-gather of f32 buffers of each size per device, on 2, 4 and all of
  `devices`: `count` independent ones in one program against one alone (the difference
  has no dispatch in it). Small buffers show the latency, larger ones the bandwidth."""
  out = []
  for k in sorted({min(2, len(devices)), min(4, len(devices)), len(devices)} - {1}):
    sub = jax.sharding.Mesh(np.array(devices[:k]), ("d",))
    for per_device in per_device_sizes:
      def seconds(c, k=k, sub=sub, per_device=per_device):
        bufs = [jax.device_put(jnp.full((k * per_device,), float(i), jnp.float32),
                               NamedSharding(sub, P("d"))) for i in range(c)]
        gather = jax.jit(lambda xs: [2 * x for x in xs],
                         out_shardings=[NamedSharding(sub, P())] * c)
        return timeit(gather, bufs, repeats=10)
      one, many = seconds(1), seconds(count)
      out.append({"devices": k, "bytes": 4 * k * per_device, "count": count,
                  "seconds": max(many - one, 0.0) / (count - 1)})
  return out


# Calibration workloads of the real stages: (devices, mode, generate / infer / train
# meshes, generation micro-batches, batch, minibatch, prompt length, new tokens). Their
# own sizes, not an experiment's: the fit must extrapolate, not remember.
_SMALL = (16, 8, 12, 6)
_LARGE = (48, 16, 20, 10)
STAGE_POINTS = (
    (1, "sequential", {}, {}, {}, 1, _SMALL),
    (1, "sequential", {}, {}, {}, 1, _LARGE),
    (8, "per_stage", dict(data=8), dict(data=8), dict(data=8), 1, _LARGE),
    (8, "per_stage", dict(pipeline=4, tensor=2), dict(fsdp=8), dict(fsdp=8), 4, _SMALL),
    (4, "per_stage", dict(pipeline=2, tensor=2), dict(data=2, tensor=2), dict(data=2, fsdp=2), 2,
     _LARGE),
    (2, "per_stage", dict(tensor=2), dict(pipeline=2), dict(tensor=2), 1, _SMALL),
)
QUICK_STAGE_POINTS = (STAGE_POINTS[0], STAGE_POINTS[2], STAGE_POINTS[3])


def _mesh(axes: dict) -> dict:
  return {"data": 1, "fsdp": 1, "tensor": 1, "pipeline": 1, **axes}


def measure_stages(cfg, points=STAGE_POINTS, repeats: int = 3) -> list[dict]:
  """Median seconds of the real stage calls at each calibration point.

  Each point builds a `PPOSystem` (random-init actor, critic and reference from `cfg`, a
  host rule reward) on its first `devices` devices and times, after one compile call,
  `generate`, `infer` and `train` as `system/modes.py` calls them (each returns only after
  its device work: they read metrics back). A point whose meshes the model does not
  divide over (`stages.common.MeshMismatch`: a model with 9 heads on a tensor=2 point) is
  skipped with a note on stderr.
  """


  devices = jax.devices()
  out = []
  for k, mode, gen, inf, trn, micro, (batch, minibatch, prompt_len, gen_len) in points:
    if k > len(devices):
      continue
    meshes = {"generate": _mesh(gen), "infer": _mesh(inf), "train": _mesh(trn)}
    if mode == "sequential":
      plan = Plan(mesh=MeshSpec(**_mesh({"data": k})))
      meshes = {s: _mesh({"data": k}) for s in meshes}
    else:
      plan = Plan(
          mode=mode, generate=StagePlan(mesh=MeshSpec(**meshes["generate"]),
                                        num_microbatches=micro),
          infer=StagePlan(mesh=MeshSpec(**meshes["infer"])),
          train=StagePlan(mesh=MeshSpec(**meshes["train"])))
    try:
      system = PPOSystem(
          Models.from_policy(init_model(cfg)),
          ppo=PPOSettings(steps=1000, batch_size=batch, minibatch_size=minibatch, epochs=1),
          sampling=SamplingSettings(max_new_tokens=gen_len, eos_id=None, pad_id=0),
          plan=plan, reward_fn=lambda p, c: [float(len(x)) for x in c],
          decode=lambda ids: " ".join(str(int(i)) for i in ids), devices=devices[:k])
    except MeshMismatch as e:
      # A real model's head counts need not divide the point's tensor axis, nor its depth
      # the pipeline axis: the fit then does without that point.
      print(f"calibration point on {k} devices skipped: {e}".splitlines()[0],
            file=sys.stderr)
      continue
    rng = np.random.default_rng(0)
    prompts = {"prompt_tokens": rng.integers(3, cfg.vocab_size, (batch, prompt_len)
                                             ).astype(np.int32),
               "prompt_mask": np.ones((batch, prompt_len), bool), "index": np.arange(batch)}
    times = {"generate": [], "infer": [], "train": []}
    # The reshard helper's moves at this point (weights, and each stage's batch in):
    # [(arrays, bytes, seconds)] per move.
    moves = {"actor": [], "critic": [], "infer": [], "train": []}
    for step in range(repeats + 1):  # step 0 compiles
      actor, actor_stats = system.actor_for_generation()
      critic, critic_stats = system.critic_for_inference()
      jax.block_until_ready((actor, critic))
      t0 = time.perf_counter()
      rollout, _ = system.generate(actor, prompts, step, system.version)
      t1 = time.perf_counter()
      exp, inf_m = system.infer(rollout, critic, actor_version=system.version,
                                critic_version=system.version)
      t2 = time.perf_counter()
      trn_m = system.train(exp, step, observed_kl=0.0)
      t3 = time.perf_counter()
      if step:
        for stage, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
          times[stage].append(seconds)
        for name, st in (("actor", actor_stats), ("critic", critic_stats)):
          moves[name].append((st.num_arrays, st.bytes, st.seconds))
        for stage, metrics, key in (("infer", inf_m, "rollout"), ("train", trn_m,
                                                                   "experience")):
          moves[stage].append(tuple(metrics[f"transfer/{key}/{field}"]
                                    for field in ("num_arrays", "bytes", "seconds")))
    # Destination replicas of each move, as the cost model counts them.
    dest = {"actor": "generate", "critic": "infer", "infer": "infer", "train": "train"}
    for name, values in moves.items():
      mesh = meshes[dest[name]]
      replicas = (composition.weight_replicas(mesh) if name in ("actor", "critic")
                  else composition.batch_replicas(mesh))
      arrays, nbytes, _ = values[0]
      if arrays:
        out.append({"stage": "reshard", "what": name, "devices": k, "mesh": mesh,
                    "arrays": arrays, "bytes": nbytes, "replicas": replicas,
                    "seconds": statistics.median(v[2] for v in values)})
    for stage, values in times.items():
      # The batch's move in is priced on its own (`composition.batch_moves`).
      moved = statistics.median(v[2] for v in moves[stage]) if stage in moves else 0.0
      out.append({"stage": stage, "devices": k, "mode": mode, "mesh": meshes[stage],
                  "num_microbatches": micro if stage == "generate" else 1,
                  "batch": batch, "minibatch": minibatch, "prompt_len": prompt_len,
                  "gen_len": gen_len, "seconds": statistics.median(values) - moved,
                  "moved_s": moved})
  return out


def nnls(columns: list[list[float]], target: list[float], weights: list[float]
         ) -> list[float]:
  """Non-negative least squares min sum (w (X c - y))^2, c >= 0, by trying every subset
  of the (few) columns: the best unconstrained fit among those with no negative entry."""

  x = np.asarray(columns, float).T * np.asarray(weights, float)[:, None]  # [samples, k]
  y = np.asarray(target, float) * np.asarray(weights, float)
  k = x.shape[1]
  best, best_err = np.zeros(k), float(np.sum(y ** 2))
  for size in range(1, k + 1):
    for subset in itertools.combinations(range(k), size):
      sol, *_ = np.linalg.lstsq(x[:, subset], y, rcond=None)
      if np.any(sol < 0):
        continue
      coef = np.zeros(k)
      coef[list(subset)] = sol
      err = float(np.sum((x @ coef - y) ** 2))
      if err < best_err - 1e-18:
        best, best_err = coef, err
  return [float(c) for c in best]


def fit_stages(samples: dict, fits: dict) -> dict:
  """Per-stage constants (`cost.STAGE_CONSTANTS`) from the real-stage samples.

  The analytic terms of each sample come from the cost model itself (`cost.*_terms`)
  with the microbenchmark constants in `fits`, so the fitted constants mean exactly what
  the planner multiplies them by. Relative residuals: small stages count as much as big.
  """
  cfg = TransformerConfig(**samples["model"])
  hw = hardware.get(samples.get("hardware", "cpu"))
  known = {f.name for f in dataclasses.fields(cost.Efficiency)}
  fitted_here = {name for names in cost.STAGE_CONSTANTS.values() for name in names}
  machine = cost.Machine(hw, cost.Efficiency(
      **{k: v for k, (v, _) in fits.items() if k in known and k not in fitted_here}))
  out = {}
  for stage, names in cost.STAGE_CONSTANTS.items():
    rows = [s for s in samples["stages"] if s["stage"] == stage]
    if not rows:
      continue
    cols, target, weights = [[], [], [], [], []], [], []
    for s in rows:
      work = space.Workload(actor=cfg, batch_size=s["batch"], minibatch_size=s["minibatch"],
                            epochs=1, prompt_len=s["prompt_len"], gen_len=s["gen_len"],
                            num_devices=s["devices"], reward_model=False)
      plan = StagePlan(mesh=MeshSpec(**s["mesh"]), num_microbatches=s["num_microbatches"])
      terms = cost.stage_terms(stage, plan, s["mesh"], work, machine)
      for col, value in zip(cols, (terms.roofline, 1.0, terms.units, terms.device_units,
                                   terms.exchanges)):
        col.append(value)
      # The non-matmul work at the passes this machine carries (fitted across sizes,
      # `fit_elementwise`; one model's points cannot tell it from the scale).
      elementwise = getattr(machine.eff, cost.ELEMENTWISE[stage]) * terms.elementwise
      target.append(s["seconds"] - terms.memory - terms.comm - terms.fixed - elementwise)
      weights.append(1.0 / s["seconds"])
    # Fewer points than constants leave the fit free to explain one point with a
    # constant of its own (a model whose heads skip the tensor points leaves three points
    # for five): the constants are then fitted in this order of importance, at most one
    # fewer than the points, and the rest keep their defaults.
    used = [i for i in (0, 2, 1, 3, 4) if names[i] and any(cols[i])]
    used = sorted(used[:max(1, len(rows) - 1)])
    coef = nnls([cols[i] for i in used], target, weights)
    what = {"generate": ("decode tick", "prefill + decode"),
            "infer": ("model pass", "reference + critic passes"),
            "train": ("minibatch step x model", "PPO update")}[stage]
    how = (f"{stage} stage ({what[1]}) timed at {len(rows)} calibration points; seconds = "
           "scale x roofline + per call + per {0} + per {0} x (devices - 1) + per "
           "collective exchange + analytic collectives/dispatch/Adam; non-negative least "
           "squares, relative residuals").format(what[0])
    labels = ("seconds per analytic roofline second", "seconds per call",
              f"seconds per {what[0]}", f"seconds per {what[0]} per extra device",
              "seconds per collective exchange beyond the microbenchmarked latency")
    for i, value in zip(used, coef):
      out[names[i]] = (value, f"{labels[i]}: {how}")
  return out


def heldout_split(samples: list[dict], held_out: str) -> tuple[list[dict], list[dict]]:
  """(fit, check): the samples of every model but `held_out` (their "shape"), and those of
  `held_out` alone; the check's model never enters the fit."""
  fit_rows = [s for s in samples if s["shape"] != held_out]
  return fit_rows, [s for s in samples if s["shape"] == held_out]


def fit_elementwise(samples: list[dict]) -> dict[str, float]:
  """Passes per activation element of each stage (`cost.ELEMENTWISE`) from real-stage
  timings at several model sizes.

  Each sample: "stage", "seconds" (measured), "predicted" (the cost model's seconds with
  the term off) and "elementwise" (the term's seconds at one pass,
  `cost.StageTerms.elementwise`). Per stage, c >= 0 minimising sum over samples of
  ((predicted + c x elementwise - seconds) / seconds)^2: relative residuals, so a small
  size counts as much as a big one. Closed form of that one-column least squares.
  """
  out = {}
  for stage, name in _elementwise_names().items():
    rows = [s for s in samples if s["stage"] == stage and s["elementwise"] > 0]
    if not rows:
      continue
    num = sum(s["elementwise"] * (s["seconds"] - s["predicted"]) / s["seconds"] ** 2
              for s in rows)
    den = sum((s["elementwise"] / s["seconds"]) ** 2 for s in rows)
    out[name] = max(0.0, num / den)
  return out


def _elementwise_names() -> dict[str, str]:
  return cost.ELEMENTWISE


def fit(samples: dict) -> dict:
  """The efficiency constants from raw samples, each with how it was obtained."""
  fits = {}
  device_peak = max(s["flops"] / s["seconds_one"] for s in samples["matmul"])
  host_peak = max(s["flops"] * samples["devices"] / s["seconds_all"]
                  for s in samples["matmul"])
  fits["device_peak_flops"] = (device_peak, "best f32 matmul FLOP/s on one device")
  fits["host_peak_flops"] = (max(host_peak, device_peak),
                             "best f32 matmul FLOP/s, one matmul per device at once")
  bw = samples["bandwidth"]["bytes"] / samples["bandwidth"]["seconds"]
  fits["hbm_bw"] = (bw, "bytes/s of the faster of a sum and a matrix-vector product "
                    "(one read)")
  fits["dispatch_s"] = (samples["dispatch"]["seconds"], "seconds of a trivial jitted call")
  a, b = fit_line([s["flops"] for s in samples["forward"]],
                  [s["seconds"] for s in samples["forward"]])
  fits["matmul"] = (1 / (b * device_peak), "forward: seconds = c + FLOPs / (device peak x "
                    "matmul), least squares")
  fits["call_overhead_s"] = (max(a, samples["dispatch"]["seconds"]),
                             "forward fit's intercept (at least the dispatch time)")
  _, b = fit_line([s["flops"] for s in samples["train"]],
                  [s["seconds"] for s in samples["train"]])
  fits["train"] = (1 / (b * device_peak), "forward+backward: seconds = c + FLOPs / "
                   "(device peak x train), least squares")
  if samples.get("concurrency"):
    one = next(s["seconds"] for s in samples["concurrency"] if s["copies"] == 1)
    fits["host_concurrency"] = (max(s["copies"] * one / s["seconds"]
                                    for s in samples["concurrency"]),
                                "throughput of k concurrent single-device forward+backward "
                                "steps / one alone, best k")
  for s in samples.get("split", []):
    fits[f"{s['kind']}_device_overhead_s"] = (
        max(0.0, s["seconds"] - s["seconds_one"]) / (s["devices"] - 1),
        f"{s['kind']}: (seconds split over {s['devices']} devices - on one) / "
        f"{s['devices'] - 1}: what each extra device's program adds")
  a, b = fit_line([s["bytes"] for s in samples["decode"]],
                  [s["seconds"] for s in samples["decode"]])
  fits["tick_overhead_s"] = (a, "decode step (in a fori_loop): seconds = tick + bytes / "
                             "(hbm_bw x decode_bw), least squares intercept")
  fits["decode_bw"] = (1 / (b * bw) if b > 0 else 1.0, "the same fit's slope vs hbm_bw")
  gathers = samples["all_gather"]
  if gathers and "count" in gathers[0]:
    serial = hardware.get(samples.get("hardware", "cpu")).serial_collectives
    hops = [(s["devices"] - 1) if serial else 1.0 for s in gathers]
    moved = [s["bytes"] * (s["devices"] - 1) / s["devices"] for s in gathers]
    alpha, beta = nnls([hops, moved], [s["seconds"] for s in gathers],
                       [1 / max(s["seconds"], 1e-9) for s in gathers])
    how = ("all-gathers of {} - {} B on {} devices, {} per program: seconds each = "
           "{}alpha + V (k-1)/k / W, non-negative least squares, relative residuals"
           ).format(min(s["bytes"] for s in gathers), max(s["bytes"] for s in gathers),
                    "/".join(str(k) for k in sorted({s["devices"] for s in gathers})),
                    gathers[0]["count"], "(k-1) " if serial else "")
    fits["link_latency"] = (alpha, how + "; alpha" + (" (per exchange)" if serial else ""))
    fits["link_bw"] = (1 / beta if beta > 0 else 0.0, "the same fit's W (bytes/s)")
  elif gathers:  # samples of an earlier calibration: one all-gather per program
    k = gathers[0]["devices"]
    a, b = fit_line([s["bytes"] * (k - 1) / k for s in gathers],
                    [s["seconds"] for s in gathers])
    fits["link_latency"] = (a, "all-gather: seconds = alpha + V (k-1)/k / W; alpha")
    fits["link_bw"] = (1 / b if b > 0 else 0.0, "the same fit's W (bytes/s)")
  if samples.get("optimizer"):
    o = samples["optimizer"]
    busy = max(o["seconds"] - samples["dispatch"]["seconds"], 1e-12)
    fits["optimizer_bw"] = (o["bytes"] / busy / bw, "Adam update: 7 x parameter bytes / "
                            "(seconds - dispatch) / hbm_bw")
  moves = [s for s in samples.get("stages", []) if s["stage"] == "reshard"]
  if moves:
    per_array, per_byte = nnls([[s["arrays"] for s in moves],
                                [s["bytes"] * s["replicas"] for s in moves]],
                               [s["seconds"] for s in moves],
                               [1 / max(s["seconds"], 1e-9) for s in moves])
    how = (f"the reshard helper's {len(moves)} moves (weights, rollouts, experience) at "
           "the stage points: seconds = arrays x a + bytes x destination replicas / W, "
           "non-negative least squares, relative residuals")
    fits["reshard_array_s"] = (per_array, how + "; a")
    fits["reshard_bw"] = (1 / per_byte if per_byte > 0 else 0.0, "the same fit's W")
  if samples.get("stages"):
    # Carried so that the file says which passes its stage constants were fitted beside.
    for name in _elementwise_names().values():
      fits[name] = (cost.FITTED_ELEMENTWISE[name], "passes per activation element of the "
                    "stage's non-matmul work, fitted across model sizes "
                    "(experiments/fit_elementwise.py); one model's stage points cannot "
                    "tell it from the scale")
    stage_fits = fit_stages(samples, fits)
    for name, value in stage_fits.items():
      if name in fits:  # the microbenchmark's estimate, kept for the record
        fits["microbenchmark_" + name] = fits[name]
      fits[name] = value
  return fits


def efficiency_dict(fits: dict, source: str) -> dict:

  known = {f.name for f in dataclasses.fields(cost.Efficiency)}
  values = {k: v for k, (v, _) in fits.items() if k in known}
  values["source"] = source
  return values


def _config_model(path: str):
  """The actor's TransformerConfig of the experiment config at `path`."""

  spec = importlib.util.spec_from_file_location("_calib_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  model = ModelSettings.from_config(config.model)
  return model.role_configs(load_tokenizer(model.tokenizer))["actor"]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m pipe_rlhf_jax.planner.calibrate",
      description="Time the matmul peak, memory bandwidth, collectives and the PPO stages "
                  "of an experiment's model on this backend, and fit the planner's cost "
                  "model to them (every fitted constant is printed and saved).",
      epilog="example:\n  python -m pipe_rlhf_jax.planner.calibrate --out calib.json\n"
             "  python -m pipe_rlhf_jax.plan --config=configs/quickstart.py "
             "--calibration=calib.json",
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="calibration JSON to write")
  parser.add_argument("--config", default="configs/quickstart.py",
                      help="experiment config whose model is timed")
  parser.add_argument("--quick", action="store_true", help="fewer points (tests)")
  args = parser.parse_args(argv)
  use_virtual_cpu_devices()
  use_memory_lean_scheduler()
  cfg = _config_model(args.config)
  start = time.perf_counter()
  samples = measure(cfg, quick=args.quick)
  fits = fit(samples)
  source = (f"calibrated on {samples['backend']} ({samples['device_kind']}, "
            f"{samples['devices']} devices) by planner.calibrate, {time.strftime('%Y-%m-%d')}")
  result = {"source": source, "model": str(cfg.num_params()) + " params",
            "seconds": time.perf_counter() - start, "samples": samples,
            "fits": {k: {"value": v, "how": how} for k, (v, how) in fits.items()},
            "efficiency": efficiency_dict(fits, source)}
  for name, (value, how) in fits.items():
    print(f"{name:>18} = {value:.4g}   ({how})")
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {args.out} in {result['seconds']:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
