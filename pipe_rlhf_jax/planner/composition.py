"""A plan's cost from its stages' costs (`planner.cost`): what moves between stages and
how the stages share time.

Owns the weight sync (after each update the actor moves train -> generate and the critic
train -> infer; `sequential`: one layout, nothing moves), the batches moved in between
stage layouts (`batch_moves`, priced with the reshard helper's calibrated model),
which `pipe` stages cannot overlap on the hardware (`exclusive_stages`), each stage's
share of a shared host (`stage_demands`), the closed-form step time, and `compose` /
`plan_cost`, the one place that turns stage costs into a `PlanCost` (the search and the
simulator start from it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pipe_rlhf_jax.config import STAGES, Plan
from pipe_rlhf_jax.planner.cost import Machine, StageCost, stage_cost
from pipe_rlhf_jax.planner.memory import param_bytes
from pipe_rlhf_jax.planner.space import Workload


def weight_replicas(mesh: dict) -> float:
  """Copies of a model's weights on a stage's mesh: its devices over the fsdp x tensor x
  pipeline ways that split them."""
  return math.prod(mesh.values()) / (mesh["fsdp"] * mesh["tensor"] * mesh["pipeline"])


def batch_replicas(mesh: dict) -> float:
  """Copies of a batch on a stage's mesh: its devices over the data x fsdp ways that
  split the rows."""
  return math.prod(mesh.values()) / (mesh["data"] * mesh["fsdp"])


def reshard_seconds(arrays: float, copied_bytes: float, m: Machine) -> float:
  """One call of the reshard helper moving `arrays` arrays, `copied_bytes` written over
  all destination devices: the calibrated model when there is one, else the bytes over
  the link."""
  if m.eff.reshard_bw:
    return arrays * m.eff.reshard_array_s + copied_bytes / m.eff.reshard_bw
  bw, lat = m.link(False)
  return lat + copied_bytes / bw


def batch_arrays(work: Workload) -> dict[str, tuple[int, float]]:
  """(arrays, bytes) of the batch each stage receives from the one before it: the
  rollout (`ppo.types.Rollout`: prompt and completion tokens and masks, behaviour
  log-probs, version) and the experience (`Experience`: the rollout and 7 f32
  [batch, T] fields (no values without a critic) and the scores)."""
  b, lp, t = work.batch_size, work.prompt_len, work.gen_len
  rollout = (6, b * (lp * (4 + 1) + t * (4 + 1 + 4)) + 4)
  per_token = 7 if work.critic_model else 6
  return {"infer": rollout,
          "train": (rollout[0] + per_token + 1, rollout[1] + b * (per_token * t + 1) * 4)}


def batch_moves(plan: Plan, shapes: dict[str, dict], work: Workload,
                m: Machine) -> dict[str, float]:
  """Seconds each stage spends moving its batch in from the previous stage's layout
  (`PPOSystem.infer` / `.train` reshard it first): nothing in `sequential` or where the
  two stages split the batch the same way over the same devices."""
  out = {s: 0.0 for s in STAGES}
  if plan.mode == "sequential":
    return out
  for src, dst in (("generate", "infer"), ("infer", "train")):
    a, b = shapes[src], shapes[dst]
    # Devices fill (data, fsdp, pipeline, tensor) row-major: equal data and fsdp sizes put
    # every batch shard on the same devices.
    if plan.mode == "per_stage" and (a["data"], a["fsdp"]) == (b["data"], b["fsdp"]):
      continue
    arrays, nbytes = batch_arrays(work)[dst]
    out[dst] = reshard_seconds(arrays, nbytes * batch_replicas(b), m)
  return out


def sync_time(plan: Plan, mesh_sizes: dict[str, dict], work: Workload,
              m: Machine) -> float:
  """Seconds to move the new actor train -> generate and critic train -> infer.

  Each destination device receives its shard (parameters / its fsdp x tensor x pipeline
  ways) and each source device sends its shard to every destination replica; the slower
  side bounds the transfer. `sequential`: one layout for all stages, nothing moves.
  Shared hardware: every byte goes through the host's memory, one after another.
  """
  if plan.mode == "sequential":
    return 0.0
  total = 0.0
  src = mesh_sizes["train"]
  n_src = math.prod(src.values())
  moves = [("generate", work.actor)] + ([("infer", work.critic)] if work.critic_model else [])
  for dst_stage, cfg in moves:
    dst = mesh_sizes[dst_stage]
    n_dst = math.prod(dst.values())
    w = param_bytes(cfg)
    replicas = weight_replicas(dst)
    dst_ways = n_dst / replicas
    if m.hw.shared_host:
      total += reshard_seconds(sum(cfg.num_param_arrays()), w * replicas, m)
      continue
    hosts = plan.mode == "pipe" and (n_src + n_dst > m.hw.devices_per_host)
    bw, lat = m.link(hosts)
    total += lat + max(w / dst_ways, w * replicas / n_src) / bw
  return total + 2 * m.eff.call_overhead_s


@dataclasses.dataclass(frozen=True)
class PlanCost:
  """Predicted seconds of each stage per step, the weight sync, and the closed-form step
  time (the simulator refines it for `pipe`)."""

  stages: tuple[tuple[str, StageCost], ...]
  sync: float
  closed_form: float
  demands: dict[str, float] | None = dataclasses.field(default=None, hash=False)
  exclusive: frozenset = frozenset()

  def stage(self, name: str) -> float:
    return dict(self.stages)[name].total

  def as_dict(self) -> dict[str, Any]:
    return {**{s: c.total for s, c in self.stages}, "sync": self.sync,
            "closed_form": self.closed_form}


def closed_form(times: dict[str, float], sync: float, plan: Plan,
                demands: dict[str, float] | None = None,
                exclusive: frozenset = frozenset()) -> float:
  """Steady seconds per step without queueing detail.

  Time-shared modes: the stages and the sync one after another. pipe: the slowest worker
  (the trainer's update includes the sync), and the staleness gate: generation of batch k
  waits for the update of batch k - s - 1, so (s + 1) periods cover one batch's whole
  chain. With `demands` (shared hardware: the fraction of the host each stage uses alone),
  the host's throughput bounds the period from below by the demand-weighted work; the
  `exclusive` stages (`exclusive_stages`) never overlap, so their sum bounds it too.
  """
  serial = sum(times.values()) + sync
  if plan.mode != "pipe":
    return serial
  period = max(times["generate"], times["infer"], times["train"] + sync,
               serial / (plan.max_staleness + 1),
               sum(times[s] for s in exclusive))
  if demands is not None:
    period = max(period, sum(times[s] * demands[s] for s in times) + sync * demands["sync"])
  return period


def exclusive_stages(plan: Plan, shapes: dict[str, dict], m: Machine
                     ) -> frozenset:
  """`pipe` stages that cannot overlap one another: on hardware whose multi-device
  programs run one at a time (`Hardware.serial_multi_device`), the stages on more than
  one device."""
  if plan.mode != "pipe" or not m.hw.serial_multi_device:
    return frozenset()
  return frozenset(s for s in STAGES if math.prod(shapes[s].values()) > 1)


def stage_demands(plan: Plan, shapes: dict[str, dict], m: Machine,
                  dtype: str, costs: dict[str, StageCost] | None = None
                  ) -> dict[str, float] | None:
  """Shared hardware: each stage's share of the host's throughput when alone (None on
  dedicated hardware). The sync is a host memory copy: all of it.

  The host does `compute_rate(all)` (C devices' worth of work at once, C the measured
  concurrency). A stage's compute on n devices uses min(n, C) of them; the rest of its
  time (per-call, per-tick and per-device-program overheads, collectives: work the
  fitted constants say is not the matmuls) is serial host work, one device's worth. So
  alone a stage uses (compute x min(n, C) + rest x 1) / (C x total) of the host, and two
  stages that each leave part of it idle do overlap. Without `costs`, all of a stage's
  time is taken as compute (an upper bound on its demand).
  """
  if not m.hw.shared_host:
    return None
  host = m.compute_rate(dtype, 10 ** 9)
  one = m.compute_rate(dtype, 1)
  out = {}
  for s in STAGES:
    rate = m.compute_rate(dtype, math.prod(shapes[s].values()))
    c = costs.get(s) if costs else None
    if c is None or c.total <= 0:
      out[s] = rate / host
      continue
    compute = min(c.compute, c.total)
    out[s] = (compute * rate + (c.total - compute) * one) / (c.total * host)
  out["sync"] = 1.0
  return out


def compose(plan: Plan, shapes: dict[str, dict], costs: dict[str, StageCost],
            work: Workload, m: Machine) -> PlanCost:
  """The plan's cost from its stages' own: each stage with its batch moved in
  (`batch_moves`, as a fixed overhead), the weight sync, the shared host's demands and
  the closed-form step time."""
  moves = batch_moves(plan, shapes, work, m)
  costs = tuple((s, dataclasses.replace(costs[s], overhead=costs[s].overhead + moves[s]))
                for s in STAGES)
  sync = sync_time(plan, shapes, work, m)
  times = {s: c.total for s, c in costs}
  demands = stage_demands(plan, shapes, m, work.actor.dtype, dict(costs))
  exclusive = exclusive_stages(plan, shapes, m)
  return PlanCost(costs, sync, closed_form(times, sync, plan, demands, exclusive),
                  demands, exclusive)


def plan_cost(plan: Plan, work: Workload, m: Machine) -> PlanCost:
  from pipe_rlhf_jax.system.system import stage_mesh_shapes
  shapes = {s: v[0].as_dict() for s, v in stage_mesh_shapes(plan,
                                                           work.num_devices).items()}
  costs = {s: stage_cost(s, plan.stage(s), shapes[s], work, m) for s in STAGES}
  return compose(plan, shapes, costs, work, m)
