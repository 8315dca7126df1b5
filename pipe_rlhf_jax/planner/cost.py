"""The cost model: seconds of each stage's call under its mesh (how a plan combines them,
with the weight sync and the batches moved between stages, is `planner.composition`).

Analytic work counts (`models/flops.py`: matmul FLOPs, bytes a decode step reads) over the
hardware's peaks (`planner.hardware`) scaled by efficiency factors (`Efficiency`: fitted
by `planner.calibrate` on the current backend, or the stated defaults), plus alpha-beta
collectives. Per stage, on a mesh (data d, fsdp f, tensor t, pipeline p) of n devices:

  generate  the ticks of the delayed schedule as the early-exiting decoder runs them
            (`schedule.early_exit_schedule`: each micro-batch runs the passes of its
            longest row, from the response-length model of `planner.lengths`; with all
            rows at T it is `schedule.num_ticks(p, M, T)`; with p = 1, one prefill and
            decode steps until the batch's longest row is done; with continuous batching,
            the engine's decode steps and admissions from its pure schedule over the
            batch's response lengths; with `prefill_chunk`, each admission as that many passes
            of C prompt columns with the decode steps between them). Pass 0 of a micro-batch
            [B/(d f M), Lp] through L/p layers is a prefill, later passes decode steps;
            ticks run in lock step, so a tick costs its busy stages together (dedicated
            devices: the slowest; shared host: their summed work at the host's rate).
            decode step >= max(FLOPs / peak, (weights + the whole KV cache) bytes / HBM
            BW) per device, + all-gather of the fsdp-sharded weights, + 2 all-reduces per
            layer over tensor, + one ppermute hop over pipeline, + a fixed per-tick overhead.
  infer     forward passes (reference, critic, reward model) over [B, Lp + T]; layers
            on a pipeline axis are gathered (each stacked weight over pipeline) and the pass runs
            on n / p devices' worth of work.
  train     epochs x B / minibatch steps of actor and critic: train_flops (3 forwards; 4
            with full remat; a pipeline axis gathers the layers and repeats the work as in
            inference), fsdp all-gathers (forward, backward) and reduce-scatter,
            data all-reduce of gradients, tensor all-reduces (4 per layer), the Adam update
            (7 parameter-sized reads/writes); plus, when the update starts with the
            actor's proximal log-probs (`Workload.proximal_pass`), one actor forward
            priced as inference prices it.
Non-matmul work (elementwise ops, softmax, norms, RoPE, the head's log-softmax), which
the FLOP and byte counts leave out, is priced per stage as passes over its activation
elements (`flops.forward_elements`: per layer per token, plus the head) at the memory
bandwidth: `{stage}_elementwise` passes x elements x bytes / bandwidth (`ELEMENTWISE`).
Collectives on an axis of size k over a buffer of V bytes (the gathered / reduced size per
device; alpha = latency, W = link bandwidth): all-gather / reduce-scatter
c alpha + V/W (k-1)/k for c collectives moving V (one per weight array or per layer:
`weight_collectives`; c (k-1) alpha where every collective is k - 1 exchanges,
`Hardware.serial_collectives`), all-reduce twice that, ppermute (V bytes sent)
alpha + V/W. On shared hardware (cpu) the host's throughput bounds the sum of all
devices' work: a stage's time is its total work over the host's rate.

Times are seconds; FLOPs are matmul FLOPs; bytes are bytes.
"""

from __future__ import annotations

import dataclasses
import json
import math

from pipe_rlhf_jax.config import StagePlan
from pipe_rlhf_jax.generation import engine
from pipe_rlhf_jax.models import flops
from pipe_rlhf_jax.models.config import TransformerConfig
from pipe_rlhf_jax.planner import ticks
from pipe_rlhf_jax.planner.hardware import Hardware
from pipe_rlhf_jax.planner.memory import _BYTES, param_bytes, trained_bytes
from pipe_rlhf_jax.planner.space import Workload


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """Achieved fractions of peak and fixed overheads (fitted by `planner.calibrate`).

  Defaults (used for hardware not calibrated here) are assumptions, stated as such:
  forward matmuls at 50% of peak, training at 40% (the MFU range large-model training
  reports publish), decode at 60% of HBM bandwidth, 30 us per decode tick and 100 us per
  jitted call.

  Attributes:
    matmul: achieved / peak FLOP/s of forward passes (prefill, inference).
    train: achieved / peak FLOP/s of forward + backward.
    decode_bw: achieved / peak memory bandwidth of a decode step.
    tick_overhead_s: fixed seconds per decode step / pipeline tick (loop body launch).
    call_overhead_s: fixed seconds per jitted call (dispatch).
    host_peak_flops: measured FLOP/s of the whole host (shared hardware), overriding the
      profile's peak when set (0 = use the profile).
    device_peak_flops: measured FLOP/s of one device alone (shared hardware: how much of
      the host one device can use; 0 = the host's).
    host_concurrency: measured speed-up of running single-device work on several devices
      of a shared host at once (throughput of k concurrent copies / one copy, best k;
      0 = not measured). On this cpu a small program on one virtual device uses about one
      core, so two stages on different devices do overlap.
    forward_device_overhead_s / train_device_overhead_s / tick_device_overhead_s: shared
      host: seconds each device beyond the first adds to one forward / forward+backward
      call / decode step or pipeline tick (its own program on the same cores: launches,
      synchronisation), measured by splitting one call's batch over all devices (0 = not
      measured; dedicated devices run their programs in parallel, so it is not applied
      there).
    hbm_bw: measured memory bandwidth, bytes/s (0 = the profile's).
    link_bw / link_latency: measured collective bandwidth / latency (0 = the profile's).
    optimizer_bw: achieved / peak memory bandwidth of the Adam update (7 parameter-sized
      reads and writes; 0 = decode_bw).
    reshard_array_s / reshard_bw: the reshard helper (`parallel.reshard`, a
      `jax.device_put` between layouts: weight sync, rollouts and experience between
      stages): seconds per array moved and bytes/s of the copies (every destination
      replica counted), fitted on the real moves of the calibration's stage points (0 =
      price moves as collectives over the link).
    The per-stage constants below are fitted (`planner.calibrate`) on timings of the real
    stage functions (`GenerateStage`, `InferStage`, `TrainStage.update` through
    `PPOSystem`), by least squares over the analytic terms of this module, so they hold
    what the microbenchmarks above do not see; defaults leave the analytic model as is.
    generate_scale / infer_scale / train_scale: real-stage seconds per second of the
      analytic compute (the rooflines above, at the microbenchmarked efficiencies):
      above 1 when the stage does work the FLOP count leaves out (log-softmax over the
      vocabulary, the PPO and value losses, gradient norms, sampling) or runs its matmuls
      below the microbenchmark's rate.
    generate_call_s / infer_call_s / train_call_s: host seconds of one stage call beyond
      the jit dispatch (placing inputs, the rule reward's decoding and scoring, reading
      metrics back).
    train_step_s: seconds per minibatch step per trained model (its loss, gradient norm
      and update ops, beyond their FLOPs and bytes).
    generate_elementwise / infer_elementwise / train_elementwise: the non-matmul work
      of the stage, as passes over its activation elements at the memory bandwidth
      (dimensionless: seconds = passes x `flops.forward_elements` x bytes per element /
      bandwidth). Elements are counted per forward pass (every decode step and prefill
      for generate, each model's pass for infer, each trained model's forward per
      minibatch step for train, `flops.train_elements`: its backward, loss and
      log-softmax gradient are in the passes, and full remat adds a third of the
      layers' for the forward it re-runs). Default 0 (off): the assumed efficiencies
      already price more than the matmuls' own rate (with them the held-out step was
      40% slow, 55% with the term), so the term goes with measured rates: a calibration
      file carries `FITTED_ELEMENTWISE`, and `bench_ppo_step --shapes`' probed pricing uses
      it. `FITTED_ELEMENTWISE`: fitted by
      `experiments/fit_elementwise.py` on the real stages at three toy sizes (d = 256,
      512, 768) against rates probed in the same process on a 2-core AMD EPYC (XLA:CPU,
      f32), nothing else running, SmolLM2-135M held out: generate 33, infer 8, train 36;
      0 switches the term off. Many passes per element (a fused op needs one or two) say
      that the work is launch- and latency-bound small ops as much as memory traffic; the
      term scales as that work does, with tokens x layers x width. The docs' planner page
      gives the fit and its spread on a busy host.
    train_exchange_s: seconds per collective exchange inside the update beyond
      `link_latency` (measured on collectives alone, back to back): between two layers'
      compute the devices of a shared host also wait for each other at every exchange.
      An fsdp=2 update on this cpu (312 all-gathers per call) took 19% longer than the
      same update on data=2, where the microbenchmarked latency predicted 5%. Training
      only: the calibration's points tell it apart there (fsdp=8 and data=2 x fsdp=2
      updates); no generation point gathers weights, and fitted there it ranged from 12
      to 72 us over three calibrations of the same host.
    source: where these numbers come from.
  """

  matmul: float = 0.5
  train: float = 0.4
  decode_bw: float = 0.6
  tick_overhead_s: float = 30e-6
  call_overhead_s: float = 100e-6
  host_peak_flops: float = 0.0
  device_peak_flops: float = 0.0
  host_concurrency: float = 0.0
  forward_device_overhead_s: float = 0.0
  train_device_overhead_s: float = 0.0
  tick_device_overhead_s: float = 0.0
  hbm_bw: float = 0.0
  link_bw: float = 0.0
  link_latency: float = 0.0
  optimizer_bw: float = 0.0
  reshard_array_s: float = 0.0
  reshard_bw: float = 0.0
  generate_scale: float = 1.0
  infer_scale: float = 1.0
  train_scale: float = 1.0
  generate_call_s: float = 0.0
  infer_call_s: float = 0.0
  train_call_s: float = 0.0
  train_step_s: float = 0.0
  train_exchange_s: float = 0.0
  # Off unless the rates are measured (`FITTED_ELEMENTWISE`, see the docstring above).
  generate_elementwise: float = 0.0
  infer_elementwise: float = 0.0
  train_elementwise: float = 0.0
  source: str = "assumed defaults (no calibration)"

  @classmethod
  def load(cls, path: str) -> "Efficiency":
    """From a `planner.calibrate` JSON file (its "efficiency" section)."""
    with open(path) as f:
      data = json.load(f)
    values = data.get("efficiency", data)
    known = {f.name for f in dataclasses.fields(cls)}
    # A file written before the non-matmul term had its stage constants fitted without
    # it: the term stays off there rather than counting that work twice.
    absent = {name: 0.0 for name in ELEMENTWISE.values() if name not in values}
    return cls(**{k: v for k, v in values.items() if k in known}, **absent)


@dataclasses.dataclass(frozen=True)
class Machine:
  """Hardware + efficiency: the rates the cost model divides by."""

  hw: Hardware
  eff: Efficiency = Efficiency()

  def peak(self, dtype: str) -> float:
    """Per-device peak FLOP/s (the host's, on shared hardware)."""
    if self.hw.shared_host and self.eff.host_peak_flops:
      return self.eff.host_peak_flops
    return self.hw.peak(dtype)

  @property
  def bw(self) -> float:
    return self.eff.hbm_bw or self.hw.hbm_bw

  def link(self, spans_hosts: bool) -> tuple[float, float]:
    bw, lat = self.hw.link(spans_hosts)
    return (self.eff.link_bw or bw, self.eff.link_latency or lat)

  def compute_rate(self, dtype: str, devices: int) -> float:
    """FLOP/s that `devices` devices working together reach at peak.

    Shared host: with a measured `host_concurrency` C, one device's rate times
    min(devices, C) (the host's rate is C devices' worth); otherwise at most the host's
    peak, one device alone at most `device_peak_flops`. Dedicated devices: devices x peak.
    """
    peak = self.peak(dtype)
    if not self.hw.shared_host:
      return devices * peak
    one = self.eff.device_peak_flops or peak
    if self.eff.host_concurrency:
      return one * min(devices, self.eff.host_concurrency)
    return min(peak, devices * one)

  def bw_rate(self, devices: int) -> float:
    return self.bw if self.hw.shared_host else devices * self.bw

  def elementwise(self, elements: float, devices: int, dtype: str) -> float:
    """Seconds of one pass over `elements` activation elements spread over `devices`
    at the memory bandwidth (the stage's `{stage}_elementwise` passes multiply it)."""
    return elements * _BYTES[dtype] / self.bw_rate(devices)

  def roofline(self, flops_total: float, bytes_total: float, devices: int, dtype: str,
               eff: float) -> float:
    """Seconds of work spread evenly over `devices`: compute- or memory-bound."""
    return max(flops_total / (self.compute_rate(dtype, devices) * eff),
               bytes_total / (self.bw_rate(devices) * self.eff.decode_bw))

  # ---- collectives (V: the full buffer's bytes per device; k: axis size) -------------
  # `count`: how many separate collectives move those V bytes (`weight_collectives`):
  # each pays the latency, k - 1 times where they run as k - 1 exchanges
  # (`Hardware.serial_collectives`).
  def all_gather(self, v: float, k: int, spans_hosts: bool = False, count: float = 1
                 ) -> float:
    if k <= 1:
      return 0.0
    bw, lat = self.link(spans_hosts)
    hops = k - 1 if self.hw.serial_collectives else 1
    return count * hops * lat + v / bw * (k - 1) / k

  reduce_scatter = all_gather

  def all_reduce(self, v: float, k: int, spans_hosts: bool = False, count: float = 1
                 ) -> float:
    return 2 * self.all_gather(v, k, spans_hosts, count)

  def ppermute(self, v: float, spans_hosts: bool = False) -> float:
    bw, lat = self.link(spans_hosts)
    return lat + v / bw


@dataclasses.dataclass(frozen=True)
class StageCost:
  """Seconds of one stage's step: compute (roofline), communication, fixed overheads."""

  compute: float
  comm: float
  overhead: float

  @property
  def total(self) -> float:
    return self.compute + self.comm + self.overhead


@dataclasses.dataclass(frozen=True)
class StageTerms:
  """The analytic pieces of one stage call, before the per-stage fitted constants.

  Attributes:
    roofline: seconds of the matmul work at the microbenchmarked rates (times
      `{stage}_scale`).
    memory: seconds of memory-bound work priced on its own (the Adam update).
    comm: seconds of collectives (alpha-beta).
    fixed: analytic overheads (jit dispatches).
    units: what a per-unit overhead is charged on: decode ticks (generate), model passes
      (infer), minibatch steps x trained models (train).
    device_units: units x (devices - 1) on a shared host, else 0: each extra virtual
      device runs its own copy of the unit's program on the same cores.
    exchanges: how many latency-bound exchanges `comm` holds (each collective's count x
      its hops); filled by `stage_terms`.
    elementwise: seconds of one pass over the stage's activation elements at the memory
      bandwidth (times `{stage}_elementwise`, `ELEMENTWISE`).
  """

  roofline: float
  memory: float
  comm: float
  fixed: float
  units: float
  device_units: float
  exchanges: float = 0.0
  elementwise: float = 0.0


# Per stage: the Efficiency fields of (scale, per call, per unit, per device unit, per
# collective exchange).
# Inference has no per-pass constant of its own: its passes are the models the algorithm
# runs, the same at every calibration point, so a per-pass cost cannot be told from the
# per-call one there (both would be fitted to one number); per call it is.
STAGE_CONSTANTS = {
    "generate": ("generate_scale", "generate_call_s", "tick_overhead_s",
                 "tick_device_overhead_s", None),
    "infer": ("infer_scale", "infer_call_s", None, "forward_device_overhead_s", None),
    "train": ("train_scale", "train_call_s", "train_step_s", "train_device_overhead_s",
              "train_exchange_s"),
}


# Per stage: the Efficiency field of its non-matmul work, in passes over its activation
# elements. Kept apart from STAGE_CONSTANTS: the calibration times one model, whose points
# cannot tell passes per element from the scale (both grow with the same work), so it is
# fitted across model sizes (`calibrate.fit_elementwise`) and the calibration carries it.
ELEMENTWISE = {"generate": "generate_elementwise", "infer": "infer_elementwise",
               "train": "train_elementwise"}
# The passes fitted by experiments/fit_elementwise.py (`Efficiency`'s docstring), for
# pricing at measured rates (a calibration, a probe).
FITTED_ELEMENTWISE = {"generate_elementwise": 33.3, "infer_elementwise": 7.9,
                      "train_elementwise": 35.5}


def priced(stage: str, terms: StageTerms, eff: Efficiency) -> StageCost:
  """The stage's seconds from its terms and the fitted constants of `eff`."""
  scale, call, unit, device, exchange = (getattr(eff, name) if name else 0.0
                                         for name in STAGE_CONSTANTS[stage])
  passes = getattr(eff, ELEMENTWISE[stage])
  return StageCost(compute=scale * terms.roofline + terms.memory
                   + passes * terms.elementwise,
                   comm=terms.comm + exchange * terms.exchanges,
                   overhead=terms.fixed + call + unit * terms.units
                   + device * terms.device_units)


def weight_collectives(cfg: TransformerConfig, layers: float, m: Machine) -> float:
  """Collectives that gather the weights of `layers` layers of `cfg` and those outside
  the layers: one per weight array where collectives are not combined
  (`Hardware.serial_collectives`), else one per layer and one for the rest."""
  per_layer, other = cfg.num_param_arrays()
  if m.hw.serial_collectives:
    return per_layer * layers + other
  return layers + 1


def _device_units(m: "Machine", units: float, devices: int) -> float:
  return units * (devices - 1) if m.hw.shared_host else 0.0


def _replicated_roofline(m: Machine, flops_total: float, bytes_total: float, devices: int,
                         copies: int, dtype: str, eff: float) -> float:
  """Seconds of work that `copies` groups of `devices` devices each repeat in full.

  A pipeline axis outside the pipelined decoder shards the layers' weights, not the batch:
  the pass gathers them and every pipeline group runs all layers on the same batch shard.
  Dedicated devices run the copies side by side; a shared host runs every one of them.
  """
  if m.hw.shared_host:
    return m.roofline(copies * flops_total, copies * bytes_total, copies * devices, dtype,
                      eff)
  return m.roofline(flops_total, bytes_total, devices, dtype, eff)


def _sizes(plan_mesh) -> tuple[int, int, int, int]:
  m = plan_mesh if isinstance(plan_mesh, dict) else plan_mesh.as_dict()
  return m["data"], m["fsdp"], m["tensor"], m["pipeline"]


def _spans_hosts(devices: int, machine: Machine) -> bool:
  return not machine.hw.shared_host and devices > machine.hw.devices_per_host


def _axis_hosts(mesh: dict, machine: Machine) -> dict[str, bool]:
  """Whether a collective over each mesh axis crosses hosts.

  Devices fill the mesh row-major over (data, fsdp, pipeline, tensor) (`parallel.mesh`), so
  an axis's groups span its size times the sizes of the axes inside it.
  """
  out, inner = {}, 1
  for axis in ("tensor", "pipeline", "fsdp", "data"):
    inner *= mesh[axis]
    out[axis] = _spans_hosts(inner, machine) and mesh[axis] > 1
  return out


def generate_cost(plan: StagePlan, mesh: dict, work: Workload, m: Machine) -> StageCost:
  return _priced_stage("generate", plan, mesh, work, m)


def generate_terms(plan: StagePlan, mesh: dict, work: Workload, m: Machine) -> StageTerms:
  """Terms of one generation call (prefill + decode of the batch) under `plan`.

  Ticks run in lock step, so a tick costs what its busy stages cost together: on
  dedicated devices the slowest busy stage (a prefill, else a decode step); on a shared
  host their summed work at the host's rate for that many devices (`compute_rate`,
  bounded by its measured concurrency). Idle ticks (bubbles, finished micro-batches)
  still pay the tick overhead and the ring's ppermute. With continuous batching
  (`plan.num_slots`, no pipeline axis) the ticks are the engine's own schedule over the batch's
  response lengths (`slot_schedule.simulate` on `Workload.batch_lengths`): its decode steps of
  S slots and its admissions, each a prefill of that many prompts. A pipelined decoder
  with S < B slots runs `schedule.refill_schedule` over the same lengths, micro-batches
  of S / M rows refilled load by load, its ring carrying prompt-length messages.
  """
  cfg = work.actor
  d, f, t, p = _sizes(mesh)
  n = d * f * t * p
  mb = plan.num_microbatches if p > 1 else 1
  slots = plan.num_slots if p == 1 else 0
  if slots:
    slots = max(min(slots, work.batch_size), work.group_size)
  pipe_slots = plan.num_slots if p > 1 and 0 < plan.num_slots < work.batch_size else 0
  # Rows of one micro-batch (or the engine's slots) per device group.
  rows = (slots or (pipe_slots or work.batch_size) / mb) / (d * f)
  act = _BYTES[cfg.dtype]
  weights = param_bytes(cfg) / (t * p)  # stored per device after the fsdp all-gather
  w_read = flops.decode_step_bytes(cfg, 0, 0)  # matmul weights one token reads
  # Every step attends over the whole cache (unused slots masked, not skipped).
  columns = work.prompt_len + work.gen_len
  kv_read = flops.decode_step_bytes(cfg, rows, columns) - w_read  # KV of `rows`, all layers
  shards = d * f  # copies of the pipelined decoder working side by side
  stage_devices = n // p  # devices of one pipeline stage; the p stages work in parallel
  # Work of one pipeline stage for one tick (L/p layers of one micro-batch), over all
  # `shards` copies: (FLOPs, bytes).
  dec = (shards * flops.forward_flops(cfg, rows, 1, context=columns) / p,
         shards * (w_read + kv_read) / p)

  def prefill_work(prompts: float, length: int = work.prompt_len):
    # The head runs at each row's last prompt position only (it draws the first token).
    return (shards * flops.forward_flops(cfg, prompts, length, context=columns,
                                         head_positions=1) / p,
            shards * w_read / p)

  pre = prefill_work(work.prefill_rows(rows, p))
  # Activation elements of one stage's tick over all copies: decode step, prefill.
  dec_elems = shards * flops.forward_elements(cfg, rows, 1, context=columns) / p

  def prefill_elements(prompts: float, length: int = work.prompt_len) -> float:
    return shards * flops.forward_elements(cfg, prompts, length, context=columns,
                                           head_positions=1) / p

  def tick_elementwise(prefilling: int, decoding: int, pre_elems: float) -> float:
    if m.hw.shared_host:
      busy = prefilling + decoding
      return m.elementwise(prefilling * pre_elems + decoding * dec_elems,
                           busy * stage_devices, cfg.dtype) if busy else 0.0
    return max(m.elementwise(pre_elems, stage_devices, cfg.dtype) if prefilling else 0.0,
               m.elementwise(dec_elems, stage_devices, cfg.dtype) if decoding else 0.0)

  def tick_compute(prefilling: int, decoding: int, pre=pre) -> float:
    if m.hw.shared_host:
      busy = prefilling + decoding
      return m.roofline(prefilling * pre[0] + decoding * dec[0],
                        prefilling * pre[1] + decoding * dec[1], busy * stage_devices,
                        cfg.dtype, m.eff.matmul) if busy else 0.0
    return max(m.roofline(*pre, stage_devices, cfg.dtype, m.eff.matmul) if prefilling
               else 0.0,
               m.roofline(*dec, stage_devices, cfg.dtype, m.eff.matmul) if decoding
               else 0.0)

  hosts = _axis_hosts(mesh, m)
  layers = cfg.num_layers / p
  gather = m.all_gather(weights, f, hosts["fsdp"],
                        count=weight_collectives(cfg, layers, m))
  # A refilling pipeline's ring carries prompt-length messages on every tick.
  ring_len = work.prompt_len if pipe_slots else 1
  ring_tick = (m.ppermute(rows * ring_len * cfg.embed_dim * act, hosts["pipeline"]) if p > 1
               else 0.0)
  comm_tick = gather + 2 * layers * m.all_reduce(rows * cfg.embed_dim * act, t,
                                                 hosts["tensor"]) + ring_tick

  def prefill_comm(prompts: float, length: int = work.prompt_len) -> float:
    out = gather + 2 * layers * m.all_reduce(
        prompts * length * cfg.embed_dim * act, t, hosts["tensor"])
    if p > 1:
      out += m.ppermute(prompts * length * cfg.embed_dim * act, hosts["pipeline"])
    return out

  compute = comm = elementwise = 0.0
  num_ticks = 0
  if slots:
    timeline = ticks.engine_timeline(work.batch_lengths(), slots, work.group_size,
                                     plan.prefill_chunk, work.prompt_len)
    steps = timeline.decode_steps
    # An admission is `passes` prefill passes of `length` columns each (one of P
    # without chunking); the decode steps between them are among the timeline's.
    passes, length = engine.EngineSpec(
        num_slots=slots, prefill_chunk=plan.prefill_chunk).prefill_passes(work.prompt_len)
    num_ticks = steps + passes * len(timeline.prefill_widths)
    compute = steps * tick_compute(0, 1) + passes * sum(
        tick_compute(1, 0, prefill_work(w / (d * f), length))
        for w in timeline.prefill_widths)
    comm = steps * comm_tick + passes * sum(prefill_comm(w / (d * f), length)
                                            for w in timeline.prefill_widths)
    elementwise = steps * tick_elementwise(0, 1, 0.0) + passes * sum(
        tick_elementwise(1, 0, prefill_elements(w / (d * f), length))
        for w in timeline.prefill_widths)
  else:
    comm_pre = prefill_comm(work.prefill_rows(rows, p))
    pre_elems = prefill_elements(work.prefill_rows(rows, p))
    if work.response_lengths and p == 1:
      counts = (((1, 0), 1), ((0, 1), max(work.batch_lengths()) - 1))
    elif pipe_slots:
      counts = ticks.refill_counts(p, mb, work.batch_lengths(), int(pipe_slots // mb))
    else:
      counts = ticks.tick_counts(p, mb, work.gen_len, work.response_fraction, work.batch_size)
    for (prefilling, decoding), count in counts:
      num_ticks += count
      compute += count * tick_compute(prefilling, decoding)
      elementwise += count * tick_elementwise(prefilling, decoding, pre_elems)
      comm += count * (comm_pre if prefilling else comm_tick if decoding else ring_tick)
  # Two jitted calls: prefill and decode (or the pipelined decoder's one, or the engine's).
  return StageTerms(roofline=compute, memory=0.0, comm=comm,
                    fixed=2 * m.eff.call_overhead_s, units=num_ticks,
                    device_units=_device_units(m, num_ticks, n), elementwise=elementwise)


def _models(work: Workload, stage: str) -> list[TransformerConfig]:
  return work.models(stage)


def infer_cost(plan: StagePlan, mesh: dict, work: Workload, m: Machine) -> StageCost:
  return _priced_stage("infer", plan, mesh, work, m)


def _replicated_elementwise(m: Machine, elements: float, devices: int, copies: int,
                            dtype: str) -> float:
  """One pass over `elements` that `copies` groups of `devices` devices each repeat
  (as `_replicated_roofline`: a shared host runs every copy)."""
  if m.hw.shared_host:
    return m.elementwise(copies * elements, copies * devices, dtype)
  return m.elementwise(elements, devices, dtype)


def _forward_elementwise(cfg: TransformerConfig, mesh: dict, work: Workload, m: Machine
                         ) -> float:
  """Seconds of one pass over one forward's activation elements (the batch, on `mesh`)."""
  d, f, t, p = _sizes(mesh)
  elems = flops.forward_elements(cfg, work.batch_size, work.length,
                                 head_positions=work.gen_len)
  return _replicated_elementwise(m, elems, d * f * t, p, cfg.dtype)


def _forward_terms(cfg: TransformerConfig, mesh: dict, work: Workload, m: Machine
                   ) -> tuple[float, float]:
  """(compute, comm) seconds of one forward pass of `cfg` over the batch on `mesh`."""
  d, f, t, p = _sizes(mesh)
  n = d * f * t * p
  hosts = _axis_hosts(mesh, m)
  rows = work.batch_size / (d * f)
  act = _BYTES[cfg.dtype]
  fl = flops.forward_flops(cfg, work.batch_size, work.length, head_positions=work.gen_len)
  compute = _replicated_roofline(m, fl, d * f * param_bytes(cfg), n // p, p, cfg.dtype,
                                 m.eff.matmul)
  comm = m.all_gather(param_bytes(cfg) / (t * p), f, hosts["fsdp"],
                      count=weight_collectives(cfg, cfg.num_layers, m))
  comm += 2 * cfg.num_layers * m.all_reduce(rows * work.length * cfg.embed_dim * act, t,
                                            hosts["tensor"])
  # Layers sharded over pipeline: the forward's layer scan gathers each stacked weight
  # (XLA's partitioner does; no activation ring in a single forward pass).
  comm += m.all_gather(param_bytes(cfg) / t, p, hosts["pipeline"],
                       count=cfg.num_param_arrays()[0])
  return compute, comm


def infer_terms(plan: StagePlan, mesh: dict, work: Workload, m: Machine) -> StageTerms:
  """Terms of one inference call: a forward pass of each model it runs."""
  d, f, t, p = _sizes(mesh)
  n = d * f * t * p
  compute = comm = elementwise = 0.0
  for cfg in _models(work, "infer"):
    c, k = _forward_terms(cfg, mesh, work, m)
    compute, comm = compute + c, comm + k
    elementwise += _forward_elementwise(cfg, mesh, work, m)
  passes = len(_models(work, "infer"))
  return StageTerms(roofline=compute, memory=0.0, comm=comm,
                    fixed=passes * m.eff.call_overhead_s, units=passes,
                    device_units=_device_units(m, passes, n), elementwise=elementwise)


def train_cost(plan: StagePlan, mesh: dict, work: Workload, m: Machine) -> StageCost:
  return _priced_stage("train", plan, mesh, work, m)


def train_terms(plan: StagePlan, mesh: dict, work: Workload, m: Machine) -> StageTerms:
  """Terms of one PPO update: epochs x minibatch steps of each trained model."""
  d, f, t, p = _sizes(mesh)
  n = d * f * t * p
  hosts = _axis_hosts(mesh, m)
  steps = work.epochs * (work.batch_size // work.minibatch_size)
  rows = work.minibatch_size / (d * f)
  compute = memory = comm = elementwise = 0.0
  for cfg in _models(work, "train"):
    act = _BYTES[cfg.dtype]
    fl = flops.train_flops(cfg, work.minibatch_size, work.length, remat=plan.remat,
                           head_positions=work.gen_len)
    w = param_bytes(cfg)
    # What trains (with LoRA, the adapters): every replica updates its copy.
    adam_bytes = 7 * trained_bytes(cfg) * d
    compute += steps * _replicated_roofline(m, fl, 0.0, n // p, p, cfg.dtype, m.eff.train)
    # The forward's activation elements of each step (a third more of the layers' with
    # full remat: one more forward of three); the passes carry the backward's.
    elementwise += steps * _replicated_elementwise(
        m, flops.train_elements(cfg, work.minibatch_size, work.length, remat=plan.remat,
                                head_positions=work.gen_len), n // p, p, cfg.dtype)
    memory += steps * adam_bytes / (m.bw_rate(n) * (m.eff.optimizer_bw or m.eff.decode_bw))
    shard = w / (t * p)
    gathers = weight_collectives(cfg, cfg.num_layers, m)
    # Gradients are reduced per layer, a layer's arrays in one collective (seen in XLA:CPU's
    # compiled update too).
    reductions = cfg.num_layers + 1
    grad_shard = trained_bytes(cfg) / (t * p)  # gradients exist for what trains only
    comm_step = (2 * m.all_gather(shard, f, hosts["fsdp"], count=gathers)
                 + m.reduce_scatter(grad_shard, f, hosts["fsdp"], count=reductions))
    comm_step += m.all_reduce(grad_shard / f, d, hosts["data"], count=reductions)
    comm_step += 4 * cfg.num_layers * m.all_reduce(rows * work.length * cfg.embed_dim * act,
                                                   t, hosts["tensor"])
    # Layers sharded over pipe (sequential mode's one mesh): gathered before the layer
    # scan as in inference, their gradients reduced back.
    stacked = cfg.num_param_arrays()[0]
    comm_step += (m.all_gather(w / t, p, hosts["pipeline"], count=stacked)
                  + m.reduce_scatter(w / t, p, hosts["pipeline"], count=stacked))
    comm += steps * comm_step
  units = steps * len(_models(work, "train"))
  if work.ptx_rows:
    # The SFT term: the actor's forward and backward over the demonstrations of each step.
    fl = flops.train_flops(work.actor, work.ptx_rows, work.length, remat=plan.remat,
                           head_positions=work.gen_len)
    compute += steps * _replicated_roofline(m, fl, 0.0, n // p, p, work.actor.dtype,
                                            m.eff.train)
    elementwise += steps * _replicated_elementwise(
        m, flops.train_elements(work.actor, work.ptx_rows, work.length, remat=plan.remat,
                                head_positions=work.gen_len), n // p, p, work.actor.dtype)
  if work.proximal_pass:
    # The actor's forward over the whole batch before the first step, as in inference.
    c, k = _forward_terms(work.actor, mesh, work, m)
    compute, comm, units = compute + c, comm + k, units + 1
    elementwise += _forward_elementwise(work.actor, mesh, work, m)
  return StageTerms(roofline=compute, memory=memory, comm=comm, fixed=m.eff.call_overhead_s,
                    units=units, device_units=_device_units(m, units, n),
                    elementwise=elementwise)


STAGE_COSTS = {"generate": generate_cost, "infer": infer_cost, "train": train_cost}
STAGE_TERMS = {"generate": generate_terms, "infer": infer_terms, "train": train_terms}


def _priced_stage(stage: str, plan: StagePlan, mesh: dict, work: Workload, m: Machine
                  ) -> StageCost:
  # Exchanges are counted only where a fitted constant prices them.
  name = STAGE_CONSTANTS[stage][4]
  count = bool(name and getattr(m.eff, name))
  return priced(stage, stage_terms(stage, plan, mesh, work, m, count_exchanges=count),
                m.eff)


def stage_terms(stage: str, plan: StagePlan, mesh: dict, work: Workload, m: Machine,
                count_exchanges: bool = True) -> StageTerms:
  """`STAGE_TERMS[stage]` with `exchanges` filled in (unless `count_exchanges` is off:
  pricing skips the count where no fitted constant multiplies it).

  Every collective here costs count x hops x latency + bytes / bandwidth, so the same
  terms on a machine of unit latency and unbounded bandwidth have `comm` = the number of
  exchanges: one statement of the collectives, counted rather than copied.
  """
  terms = STAGE_TERMS[stage](plan, mesh, work, m)
  if not count_exchanges:
    return terms
  counting = Machine(m.hw, dataclasses.replace(m.eff, link_latency=1.0,
                                               link_bw=math.inf))
  return dataclasses.replace(
      terms, exchanges=STAGE_TERMS[stage](plan, mesh, work, counting).comm)


def stage_cost(stage: str, plan: StagePlan, mesh: dict, work: Workload, m: Machine
               ) -> StageCost:
  return STAGE_COSTS[stage](plan, mesh, work, m)
