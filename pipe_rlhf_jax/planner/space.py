"""The hierarchical plan space: which `Plan`s are valid for a model, a batch and a
device count, and their conversion to and from config overrides.

Levels (each plain, hashable data):
  1. `Schedule`: mode, `max_staleness`, `queue_size`;
  2. placement: device counts of (generate, infer, train) — contiguous blocks in device
     order; on multi-host hardware each block is a whole number of hosts (or lies inside
     one host);
  3. per stage: `MeshSpec(data, fsdp, tensor, pipeline)` on its devices, generation
     micro-batches M (only with pipeline > 1: M in {1, P, 2P, 4P} dividing the batch), and the
     training stage's remat policy.
A plan is the system's own `Plan`. Validity is decided by the system's checks,
called here on abstract meshes (no devices needed): `system.stage_mesh_shapes`,
`system.check_fits`, `system.check_batch_fits` and
`generation.schedule.validate_pipeline_config` — shared, not copied. The memory limit is
checked separately (`planner.memory`), since it depends on the hardware.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Iterator

from flax import nnx
import jax

from pipe_rlhf_jax import checks
from pipe_rlhf_jax.config import STAGES, MeshSpec, Plan, StagePlan
from pipe_rlhf_jax.generation import schedule as sched
from pipe_rlhf_jax.models.config import TransformerConfig
from pipe_rlhf_jax.parallel import logical
from pipe_rlhf_jax.parallel.mesh import MESH_AXES, describe
from pipe_rlhf_jax.planner import lengths
from pipe_rlhf_jax.stages.common import StageLayout
from pipe_rlhf_jax.system import system

MODES = ("sequential", "per_stage", "pipe")


@dataclasses.dataclass(frozen=True)
class Workload:
  """What is planned: the models, one PPO step's sizes, and the devices.

  Attributes:
    actor: the policy's config (the critic, reference and reward model are taken to have
      its backbone; the critic/reward get a scalar head). With LoRA adapters
      (`lora_rank` > 0) the critic carries them too; the reference and the reward model
      are the base.
    batch_size: rollouts per PPO step (B).
    minibatch_size: rollouts per gradient step.
    epochs: passes over each batch.
    prompt_len: prompt tokens per rollout (Lp).
    gen_len: generated tokens per rollout (T = max_new_tokens: the decoder runs all T).
    num_devices: devices to plan for.
    devices_per_host: devices of one host (placement blocks align to hosts when > 1).
    reward_model: a reward model runs in inference (else a host rule reward).
    critic_model: the advantage estimator reads a critic (False: critic-free, e.g. GRPO).
    reference_model: a reference policy runs in inference (False when kl_coef = 0).
    response_fraction: mean response length over `gen_len` (rows stop at EOS; 1 = every
      row runs all T tokens). Generation is priced with the passes its longest rows
      need (`planner.lengths`); inference and training always see T positions.
    proximal_pass: the update starts with one forward pass of the actor over the batch
      (`stages.train.TrainSettings.proximal_pass`: decoupled loss, the rewards' KL at the
      trainer's policy, or the early stop).
    ptx_rows: demonstrations per actor gradient step of the SFT term (`ppo.ptx_coef`;
      0 = none): one more actor forward and backward over that many rows per step.
    group_size: completions per prompt (`ppo.group_size`): the plain sampler prefills
      each of the batch_size / group_size prompts once.
    response_lengths: observed response lengths (tokens), when known: generation is then
      priced on their distribution instead of the constant-hazard model of
      `response_fraction` (plain decoder; the pipelined decoder keeps the model).
  """

  actor: TransformerConfig
  batch_size: int
  minibatch_size: int
  epochs: int
  prompt_len: int
  gen_len: int
  num_devices: int
  devices_per_host: int = 1
  reward_model: bool = True
  response_fraction: float = 1.0
  critic_model: bool = True
  reference_model: bool = True
  proximal_pass: bool = False
  ptx_rows: int = 0
  group_size: int = 1
  response_lengths: tuple[int, ...] = ()

  def __post_init__(self):
    checks.check_fraction(self.response_fraction, "response_fraction")
    if any(int(x) < 1 for x in self.response_lengths):
      raise ValueError("response_lengths must be token counts >= 1, got "
                       f"min {min(self.response_lengths)}")

  def batch_lengths(self) -> tuple[int, ...]:
    """The response lengths of one generation batch (`lengths.batch_lengths`)."""
    return lengths.batch_lengths(self.response_fraction, self.gen_len, self.batch_size,
                                 tuple(int(x) for x in self.response_lengths))

  def slot_counts(self, data_ways: int) -> tuple[int, ...]:
    """Slot counts worth pricing for generation: 0 (static batches)
    and, when response lengths vary, half and a quarter of the batch (whole groups,
    split evenly over the `data_ways` batch shards). Fewer slots than that leave too
    little of the batch in flight at once to pay back their refills."""
    if self.response_fraction >= 1 and not self.response_lengths:
      return (0,)
    out = [0]
    for div in (2, 4):
      s = self.batch_size // div
      if s >= self.group_size and s % self.group_size == 0 and s % data_ways == 0:
        out.append(s)
    return tuple(out)

  @property
  def critic(self) -> TransformerConfig:
    return self.actor.replace(head="value")

  def models(self, stage: str) -> list[TransformerConfig]:
    """The models `stage` runs: inference the reference, critic and reward model (those
    that exist), training the actor and the critic; generation the actor."""
    if stage == "infer":
      # The reference is the actor's base, the reward model never carries adapters.
      return ([self.actor.base] if self.reference_model else []) + (
          [self.critic] if self.critic_model else []) + (
          [self.actor.base.replace(head="score")] if self.reward_model else [])
    if stage == "train":
      return [self.actor] + ([self.critic] if self.critic_model else [])
    return [self.actor]

  @property
  def length(self) -> int:
    return self.prompt_len + self.gen_len

  def prefill_rows(self, rows: float, pipeline: int) -> float:
    """Rows a prefill of `rows` rollouts runs: the plain sampler (pipeline 1) runs each
    prompt once, the pipelined decoder every row."""
    return rows / self.group_size if pipeline == 1 else rows

  def with_devices(self, num_devices: int, devices_per_host: int | None = None) -> "Workload":
    return dataclasses.replace(self, num_devices=num_devices, devices_per_host=(
        self.devices_per_host if devices_per_host is None else devices_per_host))


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Level 1 of a plan: when the stages run."""

  mode: str
  max_staleness: int = 0
  queue_size: int = 2


@dataclasses.dataclass(frozen=True)
class SpaceOptions:
  """Which values each level may take (the search's knobs)."""

  modes: tuple[str, ...] = MODES
  staleness: tuple[int, ...] = (0, 1, 2)
  queue_sizes: tuple[int, ...] = (2,)
  train_remat: tuple[str, ...] = ("none", "full")
  microbatch_factors: tuple[int, ...] = (0, 1, 2, 4)  # M = 1 (0) or factor x P
  # Execution fields kept from the base config (not searched).
  attention: str = "auto"
  logits_chunk: int = 0


# ---- abstract validation (the system's checks on meshes without devices) -------------


@functools.lru_cache(maxsize=16)
def abstract_params(cfg: TransformerConfig) -> Any:
  """Parameter shapes and logical axes of a model, without allocating it."""
  from pipe_rlhf_jax.models.transformer import init_model
  state = nnx.state(nnx.eval_shape(lambda: init_model(cfg)))
  return state


class PlanLayout(StageLayout):
  """A `StageLayout` over a `jax.sharding.AbstractMesh`: a plan's stage, no devices.

  The system's checks (`system.check_fits`, `system.check_batch_fits`) run on it
  unchanged; only the wording of the parameter error differs (an abstract mesh has no
  device ids to name).
  """

  def check_params(self, state, field: str) -> None:
    axes = jax.tree.map(lambda v: v.get_metadata()["axes"], state,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))
    try:
      logical.check_divisible(state, axes, self.mesh, self.rules)
    except ValueError as e:
      raise ValueError(f"{field}: the model does not fit this stage's mesh "
                       f"({describe(self.mesh)}): {e}") from None


def abstract_layouts(plan: Plan, num_devices: int) -> dict[str, PlanLayout]:
  """Each stage's layout under `plan` on abstract meshes (`system.stage_mesh_shapes`)."""
  layouts = {}
  for s, (shape, rules, _) in system.stage_mesh_shapes(plan, num_devices).items():
    mesh = jax.sharding.AbstractMesh(shape.axis_sizes(), MESH_AXES)
    layouts[s] = PlanLayout(s, mesh, rules)
  return layouts


def check_plan(plan: Plan, work: Workload) -> None:
  """Raises ValueError (the system's message) when `plan` cannot run `work`.

  The same checks `PPOSystem` applies before compiling, plus the pipelined decoder's
  (`schedule.validate_pipeline_config`), which the system applies when generating.
  """
  layouts = abstract_layouts(plan, work.num_devices)
  system.check_fits(layouts, abstract_params(work.actor),
                    abstract_params(work.critic) if work.critic_model else None)
  system.check_batch_fits(layouts, work.batch_size, plan)
  pipeline = layouts["generate"].mesh.shape["pipeline"]
  if pipeline > 1:
    sched.validate_pipeline_config(work.actor.num_layers, pipeline, plan.num_microbatches,
                                   work.batch_size, field_prefix="stages.generate")


def plan_error(plan: Plan, work: Workload) -> str | None:
  """`check_plan`'s reason, or None when the plan is valid."""
  try:
    check_plan(plan, work)
  except ValueError as e:
    return str(e)
  return None


# ---- level 3: one stage's strategies --------------------------------------------------


def mesh_shapes(num_devices: int, pipe_allowed: bool = True) -> list[MeshSpec]:
  """Every (data, fsdp, tensor, pipeline) with product `num_devices`."""
  divisors = [d for d in range(1, num_devices + 1) if num_devices % d == 0]
  out = []
  for data, fsdp, tensor in itertools.product(divisors, repeat=3):
    rest, rem = divmod(num_devices, data * fsdp * tensor)
    if rem or (rest > 1 and not pipe_allowed):
      continue
    out.append(MeshSpec(data=data, fsdp=fsdp, tensor=tensor, pipeline=rest))
  return out


def _one_stage_plan(stage: str, plan: StagePlan, mode: str) -> Plan:
  """A plan that gives `stage` the plan and the other stages one trivial device each.

  One device splits nothing, so the system's checks on it reject only what `stage` does.
  """
  trivial = StagePlan(mesh=MeshSpec(data=1))
  stages = {s: (plan if s == stage else trivial) for s in STAGES}
  return Plan(mode=mode, placement=(1, 1, 1), **stages)


def stage_error(stage: str, plan: StagePlan, num_devices: int, work: Workload) -> str | None:
  """Why one stage's plan on `num_devices` devices cannot run `work` (None: it can).

  The system's own checks, applied to that stage alone (`_one_stage_plan`). They
  read only the model and the batch size, so the answer is memoised on those (the same
  strategies recur across sequence lengths, minibatch sizes and modes).
  """
  return _stage_error(stage, plan, num_devices, work.actor, work.batch_size)


@functools.lru_cache(maxsize=100_000)
def _stage_error(stage: str, stage_plan: StagePlan, num_devices: int,
                 actor: TransformerConfig, batch_size: int) -> str | None:
  work = Workload(actor=actor, batch_size=batch_size, minibatch_size=batch_size, epochs=1,
                  prompt_len=1, gen_len=1, num_devices=num_devices)
  plan = _one_stage_plan(stage, stage_plan, "pipe")
  counts = tuple(num_devices if s == stage else 1 for s in STAGES)
  plan = dataclasses.replace(plan, placement=counts)
  return plan_error(plan, work.with_devices(sum(counts), 1))


def stage_plans(stage: str, num_devices: int, work: Workload,
                options: SpaceOptions = SpaceOptions(), sequential: bool = False
                ) -> list[StagePlan]:
  """The valid strategies of one stage on `num_devices` devices (level 3).

  Generation: M = 1 without pipeline, each slot count of `Workload.slot_counts` (static
  batches, or continuous batching when lengths vary); with pipeline P > 1, M in {1, P, 2P,
  4P} (those the system accepts), each with the slot counts M divides (refilled
  micro-batches). Training: each remat policy of `options`, pipeline = 1.
  """
  out = []
  for mesh in mesh_shapes(num_devices, pipe_allowed=(stage != "train" or sequential)):
    if stage == "generate":
      ms = sorted({1 if f == 0 else f * mesh.pipeline for f in options.microbatch_factors}
                  ) if mesh.pipeline > 1 else [1]
      variants = ([dict(num_microbatches=m, num_slots=s) for m in ms
                   for s in work.slot_counts(1) if s % m == 0
                   and work.batch_size % (s // m or 1) == 0] if mesh.pipeline > 1 else
                  [dict(num_slots=s) for s in work.slot_counts(mesh.data * mesh.fsdp)])
    elif stage == "train":
      variants = [dict(remat=r) for r in options.train_remat]
    else:
      variants = [{}]
    for v in variants:
      plan = StagePlan(mesh=mesh, attention=options.attention,
                       logits_chunk=options.logits_chunk, **v)
      if sequential or stage_error(stage, plan, num_devices, work) is None:
        out.append(plan)
  return out


# ---- level 2: placements --------------------------------------------------------------


def placements(num_devices: int, devices_per_host: int = 1, coarse: bool = False
               ) -> list[tuple[int, int, int]]:
  """Device counts (generate, infer, train), all devices used, host-aligned blocks.

  The blocks are contiguous in device order (generate first). On more than one host,
  each block either is a whole number of hosts starting at a host boundary, or lies
  inside one host (so two small stages may share a host, but no stage straddles a host
  boundary with part of a host). `coarse` keeps only block sizes whose count of hosts
  (or, inside a host, of devices) is of the form 2^a or 3 * 2^a (for large device
  counts, where every composition would be too many).
  """
  per_host = devices_per_host if devices_per_host > 1 and num_devices > devices_per_host \
      else num_devices
  if num_devices % per_host:
    raise ValueError(f"{num_devices} devices are not a whole number of hosts of "
                     f"{devices_per_host}.")

  def ok(k):
    if not coarse:
      return True
    while k % 2 == 0:
      k //= 2
    return k in (1, 3)

  def block_ok(start: int, size: int) -> bool:
    if size % per_host == 0:
      return start % per_host == 0 and ok(size // per_host)
    return start // per_host == (start + size - 1) // per_host and ok(size)

  sizes = [s for s in range(1, num_devices - 1)
           if (s < per_host or s % per_host == 0)]
  out = []
  for g in sizes:
    if not block_ok(0, g):
      continue
    for i in sizes:
      t = num_devices - g - i
      if t >= 1 and block_ok(g, i) and block_ok(g + i, t):
        out.append((g, i, t))
  return out


# ---- level 1 and the whole space ------------------------------------------------------


def schedules(options: SpaceOptions = SpaceOptions()) -> list[Schedule]:
  out = []
  for mode in options.modes:
    for q in options.queue_sizes:
      if mode == "pipe":
        out += [Schedule(mode, s, q) for s in options.staleness]
      elif Schedule(mode, 0, q) not in out:
        out.append(Schedule(mode, 0, q))
  return out


def sequential_slot_counts(mesh: MeshSpec, work: Workload) -> tuple[int, ...]:
  """Slot counts for `sequential` mode's one mesh (static only when it has pipe, or
  unresolved (-1) axes whose batch ways are not known here)."""
  if mesh.pipeline != 1 or mesh.data < 1 or mesh.fsdp < 1:
    return (0,)
  return work.slot_counts(mesh.data * mesh.fsdp)


def enumerate_plans(work: Workload, options: SpaceOptions = SpaceOptions()
                    ) -> Iterator[Plan]:
  """Every valid plan of the space (exhaustive; for small device counts)."""
  n = work.num_devices
  for sch in schedules(options):
    common = dict(mode=sch.mode, max_staleness=sch.max_staleness, queue_size=sch.queue_size)
    if sch.mode == "sequential":
      for mesh in mesh_shapes(n):
        for remat in options.train_remat:
          train = StagePlan(mesh=MeshSpec(data=1, fsdp=-1), remat=remat,
                            attention=options.attention, logits_chunk=options.logits_chunk)
          other = StagePlan(attention=options.attention, logits_chunk=options.logits_chunk)
          for slots in sequential_slot_counts(mesh, work):
            rt = Plan(mesh=mesh, generate=dataclasses.replace(other, num_slots=slots),
                      infer=other, train=train, **common)
            if plan_error(rt, work) is None:
              yield rt
      continue
    if sch.mode == "per_stage":
      layouts = [(n, n, n)]
    else:
      layouts = placements(n, work.devices_per_host)
    for counts in layouts:
      per_stage = [stage_plans(s, c, work, options) for s, c in zip(STAGES, counts)]
      for g, i, t in itertools.product(*per_stage):
        yield Plan(placement=counts if sch.mode == "pipe" else None,
                            generate=g, infer=i, train=t, **common)


# ---- conversion to and from config overrides ------------------------------------------


_STAGE_DEFAULTS = {"num_microbatches": 1, "attention": "auto", "remat": "none",
                   "logits_chunk": 0, "num_slots": 0, "pack_tokens": 0}


def _has(config, key: str) -> bool:
  node = config
  for part in key.split("."):
    if node is None or not hasattr(node, "keys") or part not in node:
      return False
    node = node[part]
  return True


def to_overrides(plan: Plan, base=None) -> dict[str, Any]:
  """The plan as flat config overrides {"plan.mode": "pipe", ...}.

  Every field `Plan.from_config` reads, so applying them to an experiment config
  reproduces the plan (`from_overrides`). With `base` (the experiment ConfigDict), a
  per-stage field the base lacks is left out when the plan has its default (what
  `from_config` reads for a missing key), so the flags apply to a locked config. Mesh axes
  are always given (a missing axis reads as 1).
  """
  out: dict[str, Any] = {"plan.mode": plan.mode,
                         "plan.max_staleness": plan.max_staleness,
                         "plan.queue_size": plan.queue_size}
  if plan.placement is not None:
    for s, c in zip(STAGES, plan.placement):
      out[f"plan.placement.{s}"] = c
  for axis, size in plan.mesh.as_dict().items():
    out[f"mesh.{axis}"] = size
  for s in STAGES:
    stage = plan.stage(s)
    for axis, size in stage.mesh.as_dict().items():
      out[f"stages.{s}.mesh.{axis}"] = size
    for name, default in _STAGE_DEFAULTS.items():
      key, value = f"stages.{s}.{name}", getattr(stage, name)
      if base is None or _has(base, key) or value != default:
        out[key] = value
  return out


def override_flags(plan: Plan, base=None) -> list[str]:
  """The plan as command-line flags: `--config.plan.mode=pipe` ..."""
  return [f"--config.{k}={v}" for k, v in to_overrides(plan, base).items()]


def apply_overrides(config, overrides: dict[str, Any]):
  """A copy of an experiment ConfigDict with the overrides set (missing nodes created)."""
  import ml_collections
  config = ml_collections.ConfigDict(config.to_dict())
  for key, value in overrides.items():
    node, parts = config, key.split(".")
    for part in parts[:-1]:
      if part not in node or node[part] is None:
        node[part] = ml_collections.ConfigDict()
      node = node[part]
    node[parts[-1]] = value
  return config


def from_overrides(overrides: dict[str, Any], base=None) -> Plan:
  """The plan the overrides describe (`Plan.from_config` on a config)."""
  import ml_collections
  if base is None:
    base = ml_collections.ConfigDict({"plan": {"mode": "sequential",
                                                  "max_staleness": 0, "queue_size": 2},
                                      "mesh": {}, "stages": {s: {} for s in STAGES}})
  config = apply_overrides(base, overrides)
  if config.plan.mode != "pipe" and "placement" in config.plan:
    config.plan.placement = None
  return Plan.from_config(config)
