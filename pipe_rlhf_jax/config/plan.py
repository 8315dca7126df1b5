"""The plan's settings: `Plan` (the `plan`, `mesh` and `stages` sections of an
experiment config), each stage's `StagePlan` and `MeshSpec`, and `PlannedRun` (a plan with
the planner's prediction for it).

`Plan` is the plan: which schedule runs the stages, on which devices, with which mesh per
stage. It is hashable and prints as one line, so it can key caches and be compared across
a resume; it changes when and where things are computed, never what (except
`max_staleness`, which lets a rollout come from an older policy).

Every setting is checked when it is constructed, and an error names the field with the
config path it came from. Checks that need the devices (mesh sizes, divisibility of
parameters over mesh axes) happen when the stage layouts are built
(`system.build_layouts`, `system.check_fits`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from pipe_rlhf_jax.checks import check_choice, check_int, check_known, check_number, plain
from pipe_rlhf_jax.models.config import ATTENTION_IMPLS, REMAT_POLICIES
from pipe_rlhf_jax.parallel.mesh import MESH_AXES

MODES = ("sequential", "per_stage", "pipe")
STAGES = ("generate", "infer", "train")
# What partial rollouts do with a completion older than the staleness bound allows.
PAST_STALENESS = ("finish", "drop")

@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """Axis sizes of one mesh; -1 (at most one axis) takes the remaining devices."""

  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  pipeline: int = 1

  @classmethod
  def from_config(cls, mesh: Mapping[str, Any], field: str) -> "MeshSpec":
    values = plain(mesh)
    check_known(values, MESH_AXES, field, "mesh axes")
    # Axes a config leaves out are 1, not the class defaults (data=-1).
    return cls(**{axis: values.get(axis, 1) for axis in MESH_AXES})

  def as_dict(self) -> dict[str, int]:
    return {axis: getattr(self, axis) for axis in MESH_AXES}

  def __str__(self) -> str:
    return "x".join(f"{a}={v}" for a, v in self.as_dict().items() if v != 1) or "single"


@dataclasses.dataclass(frozen=True)
class StagePlan:
  """One stage's strategy in `per_stage` / `pipe` modes.

  Attributes:
    mesh: its mesh on its devices.
    rules: overrides of the stage's logical-axis rules, as ((logical name, mesh axes),
      ...); empty keeps `parallel.logical.STAGE_RULES[stage]`.
    num_microbatches: micro-batches of the pipelined decoder (generation with pipeline > 1).
    attention: how this stage computes attention ("auto", "dense", "blockwise",
      "dot_product"; see models/attention.py). Applies in every mode.
    remat: what each layer keeps for the backward pass ("none", "full",
      "save_matmuls"); only the training stage differentiates. Applies in every mode.
    logits_chunk: completion positions per chunk of the LM head and log-softmax
      (0: all at once). Applies in every mode.
    scan_unroll: layers per iteration of the layer scan (`TransformerConfig.scan_unroll`).
      0, the default, chooses (`unroll_for`): every layer unrolled, the faster step,
      unless the stage shards its weights over fsdp or rematerialises its layers, where
      the loop (1) keeps one layer's gathered weights and recomputation at a time. n >= 1
      asks for a loop of n layers per iteration whatever the stage (n >= the layer count:
      unrolled). Applies in every mode.
    num_slots: generation only: 0 decodes each batch as one static batch; S > 0 decodes
      the batch's prompts as a queue over S slots with continuous batching
      (`generation/engine.py`): a finished row's slot takes the next prompt at once.
      On a stage with a pipeline axis the pipelined decoder runs S / num_microbatches rows
      per micro-batch and refills a micro-batch once all its rows are done (S a
      multiple of num_microbatches). Applies in every mode.
    prefill_chunk: generation with `num_slots` > 0 on a stage without a pipeline axis:
      prompt columns per prefill pass of the engine's admissions, the decoding slots
      taking one decode step between two passes, so that a newcomer's prefill stalls the
      running decode for C columns at a time, not the whole prompt (0, the default: the
      whole prompt in one pass). Applies in every mode.
    pack_tokens: inference and training: 0 runs the stage's forward (and backward)
      passes over the padded `[batch, P + T]` layout; L > 0 packs the real tokens into
      rows of L (`stages/packing.py`; training packs each minibatch), the same outputs.
      L must hold the longest sequence. Applies in every mode.
  """

  mesh: MeshSpec = MeshSpec()
  rules: tuple[tuple[str, Any], ...] = ()
  num_microbatches: int = 1
  attention: str = "auto"
  remat: str = "none"
  logits_chunk: int = 0
  scan_unroll: int = 0
  num_slots: int = 0
  prefill_chunk: int = 0
  pack_tokens: int = 0

  def __post_init__(self):
    check_choice(self.attention, "attention", ATTENTION_IMPLS)
    check_choice(self.remat, "remat", REMAT_POLICIES)
    check_int(self.logits_chunk, "logits_chunk", low=0)
    check_int(self.scan_unroll, "scan_unroll", low=0)
    check_int(self.num_slots, "num_slots", low=0)
    check_int(self.prefill_chunk, "prefill_chunk", low=0)
    check_int(self.pack_tokens, "pack_tokens", low=0)

  def unroll_for(self, fsdp: int | None = None) -> int:
    """`TransformerConfig.scan_unroll` of this stage on a mesh of `fsdp` shards (None:
    this plan's `mesh.fsdp`; -1 there counts as sharded).

    0 resolves to every layer unrolled (0) where that is only faster, and to the loop (1)
    where the loop's one-layer-at-a-time memory is what the stage asked for: unrolled, XLA
    schedules each layer's all-gather and recomputation on its own, ahead of their use.
    Measured with XLA's `memory_analysis()` on the tests' models (tests/planner/
    test_memory.py's cases, rolled against unrolled): under fsdp=4 x tensor=2 every
    layer's gathered weights were live at once (inference 14.5 -> 32.8 MiB); with full
    remat the update kept about what it keeps without remat (41.7 -> 98.3 MiB).
    """
    if self.scan_unroll:
      return self.scan_unroll
    shards = self.mesh.fsdp if fsdp is None else fsdp
    return 1 if self.remat != "none" or shards != 1 else 0

  def execution(self, fsdp: int | None = None) -> dict[str, Any]:
    """The model execution fields this stage sets (`models.transformer.with_execution`),
    on a mesh of `fsdp` shards (`unroll_for`)."""
    return {"attention": self.attention, "remat": self.remat,
            "logits_chunk_size": self.logits_chunk, "scan_unroll": self.unroll_for(fsdp)}

  @classmethod
  def from_config(cls, stage: Mapping[str, Any], field: str) -> "StagePlan":
    values = plain(stage)
    check_known(values, ("mesh", "rules", "num_microbatches", "attention", "remat",
                         "logits_chunk", "scan_unroll", "num_slots", "prefill_chunk",
                         "pack_tokens"), field)
    rules = values.get("rules") or {}
    rules = tuple((name, tuple(a) if isinstance(a, list) else a)
                  for name, a in plain(rules).items())
    try:
      return cls(mesh=MeshSpec.from_config(values.get("mesh", {}), field + ".mesh"),
                 rules=rules, **{name: values.get(name, getattr(cls, name)) for name in (
                     "num_microbatches", "attention", "remat", "logits_chunk",
                     "scan_unroll", "num_slots", "prefill_chunk", "pack_tokens")})
    except ValueError as e:
      if str(e).startswith(("attention=", "remat=", "logits_chunk=", "scan_unroll=",
                            "num_slots=", "prefill_chunk=", "pack_tokens=")):
        raise ValueError(f"{field}.{e}") from None
      raise


@dataclasses.dataclass(frozen=True)
class Plan:
  """The plan: schedule, placement and each stage's strategy.

  Attributes:
    mode: "sequential" (one mesh, `mesh`, shared by every stage, one after another),
      "per_stage" (each stage its own mesh over all devices, one after another) or
      "pipe" (stages concurrent on disjoint device blocks of `placement`).
    max_staleness: `pipe` only: a rollout may come from a policy this many updates old
      (0 reproduces `sequential`). With partial rollouts, the bound applies to each
      completion's oldest token.
    partial_rollouts: `pipe` only, with `stages.generate.num_slots` > 0: the engine keeps
      running across PPO steps (`stages/rollout_stream.py`): a batch is the first
      `ppo.batch_size` completions to finish, unfinished rows stay in their slots and
      continue under the newest weights, each token recording the version that drew it.
    past_staleness: with partial rollouts, what happens to a completion whose oldest
      token is older than `max_staleness` allows: "finish" (it is trained on, counted in
      `rollout/past_staleness`) or "drop" (discarded and its prompt re-queued, counted
      in `rollout/dropped`).
    queue_size: `pipe` only: capacity of the rollout and experience queues.
    shutdown_timeout_s: `pipe` only: how long the other workers may take to finish their
      current item after one fails.
    progress_timeout_s: how long a PPO step (and a one-off wait between processes, such
      as another process building the datasets) may make no progress before the job
      stops, naming the stage and process that held it up
      (`concurrency/progress.py`); 0 sizes it from the slowest step seen and the planner's
      prediction.
    placement: `pipe` only: devices of (generate, infer, train), contiguous blocks in
      device order: generation and inference from the first device on, training on the
      last ones (devices they leave lie unused between inference and training).
    mesh: the one mesh of `sequential` mode.
    generate / infer / train: each stage's plan in `per_stage` and `pipe` modes.
  """

  mode: str = "sequential"
  max_staleness: int = 0
  partial_rollouts: bool = False
  past_staleness: str = "finish"
  queue_size: int = 2
  shutdown_timeout_s: float = 120.0
  progress_timeout_s: float = 0.0
  placement: tuple[int, int, int] | None = None
  mesh: MeshSpec = MeshSpec()
  generate: StagePlan = StagePlan()
  infer: StagePlan = StagePlan()
  train: StagePlan = StagePlan(mesh=MeshSpec(data=1, fsdp=-1))

  def __post_init__(self):
    check_choice(self.mode, "plan.mode", MODES)
    check_int(self.max_staleness, "plan.max_staleness", low=0)
    check_int(self.queue_size, "plan.queue_size")
    if not isinstance(self.partial_rollouts, bool):
      raise ValueError(f"plan.partial_rollouts={self.partial_rollouts!r} must be True "
                       "or False.")
    check_choice(self.past_staleness, "plan.past_staleness", PAST_STALENESS)
    if self.partial_rollouts and (self.mode != "pipe" or not self.generate.num_slots):
      raise ValueError(
          f"plan.partial_rollouts=True needs plan.mode='pipe' and "
          f"stages.generate.num_slots > 0 (the slot engine keeps unfinished rows across "
          f"updates); got mode={self.mode!r}, num_slots={self.generate.num_slots}. Set "
          "both, or partial_rollouts=False.")
    check_number(self.shutdown_timeout_s, "plan.shutdown_timeout_s")
    check_number(self.progress_timeout_s, "plan.progress_timeout_s", allow_zero=True)
    if self.mode == "pipe":
      if self.placement is None or len(self.placement) != len(STAGES):
        raise ValueError(f"plan.placement must give device counts for {STAGES} in "
                         f"pipe mode, got {self.placement}.")
      for stage, count in zip(STAGES, self.placement):
        check_int(count, f"plan.placement.{stage}")
    for stage in STAGES:
      check_int(self.stage(stage).num_microbatches, f"stages.{stage}.num_microbatches")
    for stage in ("infer", "train"):
      if self.stage(stage).num_slots:
        raise ValueError(f"stages.{stage}.num_slots={self.stage(stage).num_slots}: only "
                         "generation decodes; set stages.generate.num_slots instead.")
    if self.generate.pack_tokens:
      raise ValueError(f"stages.generate.pack_tokens={self.generate.pack_tokens}: "
                       "generation decodes, it does not pack; set stages.infer.pack_tokens "
                       "or stages.train.pack_tokens instead (0 here).")
    pipelined = self.mode != "sequential" and self.generate.mesh.pipeline > 1
    for stage in STAGES:
      chunk = self.stage(stage).prefill_chunk
      if chunk and (stage != "generate" or pipelined or not self.generate.num_slots):
        raise ValueError(
            f"stages.{stage}.prefill_chunk={chunk}: prefill passes are the continuous-"
            "batching engine's, which runs with stages.generate.num_slots > 0 on a "
            "generation mesh without a pipeline axis (the static sampler and the pipelined "
            "decoder prefill whole prompts); set it to 0, or set stages.generate.num_slots "
            "and stages.generate.mesh.pipeline=1.")
    if self.generate.num_slots and pipelined:
      if self.partial_rollouts:
        raise ValueError(
            f"plan.partial_rollouts=True with stages.generate.mesh.pipeline="
            f"{self.generate.mesh.pipeline}: the engine kept across updates is the plain "
            "decoder's; set stages.generate.mesh.pipeline=1, or partial_rollouts=False.")
      if self.generate.num_slots % self.generate.num_microbatches:
        raise ValueError(
            f"stages.generate.num_slots={self.generate.num_slots} is not a multiple of "
            f"stages.generate.num_microbatches={self.generate.num_microbatches}: the "
            "pipelined decoder refills micro-batches of num_slots / num_microbatches rows.")
    if self.mode != "sequential" and self.train.mesh.pipeline not in (1,):
      raise ValueError("stages.train.mesh.pipeline must be 1: training keeps the layer stack "
                       "whole; fold those devices into fsdp or data.")

  def stage(self, name: str) -> StagePlan:
    check_choice(name, "stage", STAGES)
    return getattr(self, name)

  @property
  def num_microbatches(self) -> int:
    """Micro-batches of generation (1 in `sequential` mode: no pipeline there)."""
    return 1 if self.mode == "sequential" else self.generate.num_microbatches

  @property
  def concurrent(self) -> bool:
    return self.mode == "pipe"

  def __str__(self) -> str:
    if self.mode == "sequential":
      return f"sequential[{self.mesh}]"
    stages = ", ".join(f"{s}: {self.stage(s).mesh}" for s in STAGES)
    if self.mode == "per_stage":
      return f"per_stage[{stages}, M={self.generate.num_microbatches}]"
    placement = "+".join(str(n) for n in self.placement)
    return (f"pipe[{placement} devices; {stages}, M={self.generate.num_microbatches}, "
            f"staleness<={self.max_staleness}, queue={self.queue_size}]")

  @classmethod
  def from_config(cls, config) -> "Plan":
    """From an experiment config's `plan`, `mesh` and `stages` sections."""
    rt = plain(config.plan)
    placement = rt.get("placement")
    if placement is not None:
      placement = plain(placement)
      if set(placement) != set(STAGES):
        raise ValueError(f"plan.placement must give device counts for exactly "
                         f"{STAGES}, got {sorted(placement)}.")
      placement = tuple(placement[s] for s in STAGES)
    stages = {s: StagePlan.from_config(config.stages[s], f"stages.{s}") for s in STAGES}
    return cls(mode=rt["mode"], max_staleness=rt["max_staleness"],
               partial_rollouts=rt.get("partial_rollouts", cls.partial_rollouts),
               past_staleness=rt.get("past_staleness", cls.past_staleness),
               queue_size=rt["queue_size"],
               shutdown_timeout_s=float(rt.get("shutdown_timeout_s", cls.shutdown_timeout_s)),
               progress_timeout_s=float(rt.get("progress_timeout_s", cls.progress_timeout_s)),
               placement=placement, mesh=MeshSpec.from_config(config.mesh, "mesh"),
               **stages)


@dataclasses.dataclass(frozen=True)
class PlannedRun:
  """The plan a run uses and what the planner predicts for it.

  Attributes:
    plan: the plan (chosen by the planner, or the hand-written one it accepted).
    chosen: True when `plan.choose = "auto"` chose it.
    predicted_step_s: the simulator's steady seconds per PPO step.
    bottleneck: the stage that bounds the step.
    memory_gib: predicted peak GiB per device, per device group.
    hardware: the profile's name.
    efficiency: where the efficiencies come from (a calibration file, or the defaults).
    search_s: seconds the search took (0 for a hand-written plan).
  """

  plan: Plan
  chosen: bool
  predicted_step_s: float
  bottleneck: str
  memory_gib: dict[str, float]
  hardware: str
  efficiency: str
  search_s: float = 0.0

  def describe(self) -> str:
    how = "chosen by the planner" if self.chosen else "hand-written, checked by the planner"
    mem = ", ".join(f"{k} {v:.2f}" for k, v in self.memory_gib.items())
    return (f"plan ({how}): {self.plan}; predicted {self.predicted_step_s:.4g} s/step "
            f"(bottleneck {self.bottleneck}; GiB/device {mem}) on {self.hardware}, "
            f"efficiencies: {self.efficiency}")
