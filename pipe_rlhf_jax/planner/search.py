"""Search: the k best plans of the space for a workload on a machine.

Two methods, one ranking (the simulator's steady seconds per step):
  exhaustive (small device counts): every valid plan (`space.enumerate_plans`) is priced
    in closed form (`composition.closed_form`), which is a lower bound of the simulated period
    (the simulator only adds waiting); plans are then simulated in increasing order of
    that bound until the bound exceeds the k-th best simulated time (branch and bound:
    the result equals simulating every plan).
  pareto (large device counts): per stage and device count, the Pareto set of that
    stage's strategies over (seconds, bytes per device), memoised; combined over
    host-aligned placements (coarse: block sizes 2^a or 3 x 2^a hosts) and schedules in
    closed form; the best candidates are checked in the simulator. Pareto sets keep, for
    each device count, every strategy no other beats on both time and memory, so the only
    plans lost are those whose stages are each dominated — never the fastest that fits.
Plans that fail the system's checks are never generated; plans over the memory limit are
rejected with the memory model's reason (`show_rejected`).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import time

from pipe_rlhf_jax.config import STAGES, Plan, StagePlan
from pipe_rlhf_jax.planner import composition, simulator, space
from pipe_rlhf_jax.planner import cost as cost_mod
from pipe_rlhf_jax.planner import memory as mem_mod
from pipe_rlhf_jax.planner.space import SpaceOptions, Workload


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A priced plan: predicted step time, per-stage seconds, memory, or why rejected."""

  plan: Plan
  step_time: float  # simulated steady seconds per step (closed form if not simulated)
  cost: composition.PlanCost | None
  memory: dict | None  # peak bytes per device per device group
  rejected: str | None = None
  staleness: float = 0.0
  busy: dict | None = None

  @property
  def bottleneck(self) -> str:
    if self.cost is None:
      return "-"
    times = {s: self.cost.stage(s) for s in STAGES}
    times["train"] += self.cost.sync if self.plan.mode == "pipe" else 0.0
    return max(times, key=times.get)


def simulate_plan(plan: Plan, pc: composition.PlanCost, m: cost_mod.Machine,
                  steps: int = 24) -> simulator.SimResult:
  times = {s: pc.stage(s) for s in STAGES}
  return simulator.simulate(times, pc.sync, plan.mode, max_staleness=plan.max_staleness,
                            queue_size=plan.queue_size, shared_host=m.hw.shared_host,
                            demands=pc.demands, exclusive=pc.exclusive, steps=steps)


@functools.lru_cache(maxsize=200_000)
def _stage(stage: str, plan: StagePlan, mesh: tuple, work: Workload, m: cost_mod.Machine):
  """(StageCost, StageMemory) of one stage strategy, memoised (plans share stages)."""
  sizes = dict(mesh)
  return (cost_mod.stage_cost(stage, plan, sizes, work, m),
          mem_mod.stage_memory(stage, plan, sizes, work))


def price(plan: Plan, work: Workload, m: cost_mod.Machine,
          simulate: bool = False) -> Candidate:
  """Memory check, cost and (optionally) simulation of one valid plan.

  Composes the memoised per-stage cost and memory (with `composition.compose`, as
  `composition.plan_cost` does, and the functions `memory.plan_memory` composes).
  """
  from pipe_rlhf_jax.system.system import stage_mesh_shapes
  shapes = {s: v[0].as_dict() for s, v in stage_mesh_shapes(plan, work.num_devices).items()}
  parts = {s: _stage(s, plan.stage(s), tuple(shapes[s].items()), work, m) for s in STAGES}
  mems = {s: p[1] for s, p in parts.items()}
  memory = mem_mod.combine(plan, mems)
  if max(memory.values()) > mem_mod.capacity(m.hw, work.num_devices):
    return Candidate(plan, math.inf, None, memory,
                     rejected=mem_mod.memory_error(plan, work, m.hw))
  pc = composition.compose(plan, shapes, {s: parts[s][0] for s in STAGES}, work, m)
  if not simulate:
    return Candidate(plan, pc.closed_form, pc, memory)
  sim = simulate_plan(plan, pc, m)
  return Candidate(plan, sim.step_time, pc, memory, staleness=sim.staleness, busy=sim.busy)


def _rank_key(c: Candidate):
  """Faster first; among equal times the plan with less staleness, then less total work
  (busy device-seconds outside the bottleneck), then fewer micro-batches."""
  work = sum(c.cost.as_dict()[s] for s in (*STAGES, "sync")) if c.cost else math.inf
  return (round(c.step_time, 12), c.plan.max_staleness, round(work, 12),
          c.plan.generate.num_microbatches, str(c.plan))


def _branch_and_bound(candidates: list[Candidate], work, m, k: int) -> list[Candidate]:
  """Simulates in increasing closed-form order until the bound passes the k-th best."""
  ordered = sorted(candidates, key=lambda c: c.step_time)
  best: list[Candidate] = []
  for c in ordered:
    if len(best) >= k and c.step_time > best[k - 1].step_time * (1 + 1e-9):
      break
    best.append(price(c.plan, work, m, simulate=True))
    best.sort(key=_rank_key)
  return best[:k]


def exhaustive(work: Workload, m: cost_mod.Machine, options: SpaceOptions = SpaceOptions(),
               k: int = 10, simulate_all: bool = False
               ) -> tuple[list[Candidate], list[Candidate]]:
  """(k best feasible plans, plans rejected for memory); every valid plan considered.

  `simulate_all` simulates every plan instead of branch and bound (the reference the
  tests compare against).
  """
  feasible, rejected = [], []
  for plan in space.enumerate_plans(work, options):
    c = price(plan, work, m, simulate=simulate_all)
    (rejected if c.rejected else feasible).append(c)
  if simulate_all:
    return sorted(feasible, key=_rank_key)[:k], rejected
  return _branch_and_bound(feasible, work, m, k), rejected


# ---- per-stage Pareto sets -------------------------------------------------------------


def _pareto(items: list[tuple[float, float, StagePlan]]) -> list[tuple[float, float, StagePlan]]:
  """Entries no other beats on both seconds and bytes (sorted by seconds)."""
  out, best_mem = [], math.inf
  for t, mem, plan in sorted(items, key=lambda x: (x[0], x[1])):
    if mem < best_mem:
      out.append((t, mem, plan))
      best_mem = mem
  return out


@functools.lru_cache(maxsize=4096)
def stage_pareto(stage: str, devices: int, work: Workload, m: cost_mod.Machine,
                 options: SpaceOptions) -> tuple[tuple[float, float, StagePlan], ...]:
  """Pareto set (seconds, bytes per device, plan) of one stage on `devices` devices.

  Strategies over the memory limit on their own are dropped here already.
  """
  limit = mem_mod.capacity(m.hw, work.num_devices)
  items = []
  for plan in space.stage_plans(stage, devices, work, options):
    mesh = plan.mesh.as_dict()
    mem = mem_mod.stage_memory(stage, plan, mesh, work).total
    if mem > limit:
      continue
    t = cost_mod.stage_cost(stage, plan, mesh, work, m).total
    items.append((t, mem, plan))
  return tuple(_pareto(items))


def pareto(work: Workload, m: cost_mod.Machine, options: SpaceOptions = SpaceOptions(),
           k: int = 10, coarse: bool | None = None, pool: int = 64
           ) -> tuple[list[Candidate], list[Candidate]]:
  """(k best plans, rejected) for large device counts via per-stage Pareto sets.

  The `pool` best combinations in closed form are re-priced (whole-plan memory check)
  and simulated.
  """
  n = work.num_devices
  coarse = n > 64 if coarse is None else coarse
  # The per-stage sets depend on the stage options only: one cache entry for every mode.
  per_stage = dataclasses.replace(options, modes=(), staleness=(), queue_sizes=())
  heap: list = []  # (-closed form, counter, plan): the pool best
  counter = itertools.count()
  rejected: list[Candidate] = []

  def offer(plan: Plan, bound: float):
    item = (-bound, next(counter), plan)
    if len(heap) < pool:
      heapq.heappush(heap, item)
    elif bound < -heap[0][0]:
      heapq.heapreplace(heap, item)

  for sch in space.schedules(options):
    common = dict(mode=sch.mode, max_staleness=sch.max_staleness, queue_size=sch.queue_size)
    if sch.mode == "sequential":
      for mesh in space.mesh_shapes(n):
        for remat, slots in itertools.product(options.train_remat,
                                              space.sequential_slot_counts(mesh, work)):
          plan = Plan(mesh=mesh, train=StagePlan(
              mesh=space.MeshSpec(data=1, fsdp=-1), remat=remat,
              attention=options.attention, logits_chunk=options.logits_chunk),
              generate=StagePlan(attention=options.attention,
                                 logits_chunk=options.logits_chunk, num_slots=slots),
              infer=StagePlan(attention=options.attention,
                              logits_chunk=options.logits_chunk), **common)
          if space.plan_error(plan, work) is None:
            c = price(plan, work, m)
            if c.rejected:
              rejected.append(c)
            else:
              offer(plan, c.step_time)
      continue
    layouts = ([(n, n, n)] if sch.mode == "per_stage"
               else space.placements(n, work.devices_per_host, coarse=coarse))
    for counts in layouts:
      sets = [stage_pareto(s, c, work, m, per_stage) for s, c in zip(STAGES, counts)]
      if not all(sets):
        continue
      for combo in itertools.product(*sets):
        plan = Plan(placement=counts if sch.mode == "pipe" else None,
                             generate=combo[0][2], infer=combo[1][2], train=combo[2][2],
                             **common)
        shapes = {s: c[2].mesh.as_dict() for s, c in zip(STAGES, combo)}
        costs = {s: _stage(s, c[2], tuple(shapes[s].items()), work, m)[0]
                 for s, c in zip(STAGES, combo)}
        offer(plan, composition.compose(plan, shapes, costs, work, m).closed_form)
  best = []
  for _, _, plan in sorted(heap, key=lambda x: -x[0]):
    c = price(plan, work, m, simulate=True)
    (rejected if c.rejected else best).append(c)
  best.sort(key=_rank_key)
  return best[:k], rejected


def search(work: Workload, m: cost_mod.Machine, options: SpaceOptions = SpaceOptions(),
           k: int = 10, method: str = "auto") -> tuple[list[Candidate], list[Candidate], dict]:
  """The k best plans, the rejected ones, and search statistics (method, seconds)."""
  if method == "auto":
    method = "exhaustive" if work.num_devices <= 16 else "pareto"
  start = time.perf_counter()
  if method == "exhaustive":
    best, rejected = exhaustive(work, m, options, k)
  elif method == "pareto":
    best, rejected = pareto(work, m, options, k)
  else:
    raise ValueError(f"method={method!r}; choose 'auto', 'exhaustive' or 'pareto'.")
  return best, rejected, {"method": method, "seconds": time.perf_counter() - start}
