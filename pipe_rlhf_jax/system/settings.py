"""Typed settings of the PPO system: the algorithm (`PPOConfig`) and the plan (`Plan`).

The experiment configs are `ml_collections.ConfigDict`s, convenient on a command line; the
system itself takes these frozen dataclasses, converted once at the edge
(`PPOConfig.from_config(config.ppo)`, `Plan.from_config(config)`). A researcher
using the library builds them directly. Sampling settings are
`generation.sampler.SamplingParams`.

Every setting is checked when it is constructed, and an error names the field (with the
config path it came from, e.g. `ppo.clip_eps`) and what is allowed. Checks that need the
devices (mesh sizes, divisibility of parameters over mesh axes) happen when the stage
layouts are built (`system.build_layouts`, `system.check_fits`).

`Plan` is the plan: which schedule runs the stages, on which devices, with which
mesh per stage. It is hashable and prints as one line, so it can key caches and be
compared across a resume; it changes when and where things are computed, never what
(except `max_staleness`, which lets a rollout come from an older policy).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from pipe_rlhf_jax.checks import check_choice, check_int, check_known, check_number
from pipe_rlhf_jax.parallel.mesh import MESH_AXES

MODES = ("sequential", "per_stage", "pipe")
KL_PLACEMENTS = ("reward", "loss")  # where the KL to the reference acts (ppo.kl_in)
STAGES = ("generate", "infer", "train")
# What partial rollouts do with a completion older than the staleness bound allows.
PAST_STALENESS = ("finish", "drop")


def _plain(node: Any) -> Any:
  """A ConfigDict / mapping as a plain dict (leaves untouched)."""
  return node.to_dict() if hasattr(node, "to_dict") else dict(node)


@dataclasses.dataclass(frozen=True)
class PPOConfig:
  """The PPO algorithm: update sizes, optimisers, loss, KL penalty, advantages.

  Field names equal the keys of an experiment config's `ppo` section, so
  `PPOConfig.from_config(config.ppo)` is a plain copy (sampling keys excluded).

  Attributes:
    steps: PPO steps the learning-rate schedules span.
    batch_size: rollouts per PPO step.
    minibatch_size: rollouts per gradient step; divides `batch_size`.
    epochs: passes over each batch.
    actor_lr / critic_lr: peak learning rates (AdamW).
    lr_schedule: "constant" or "cosine" (after `warmup_steps` of linear warmup).
    max_grad_norm: global-norm gradient clipping.
    clip_eps / value_clip_eps: PPO ratio and value clipping.
    entropy_coef: weight of the entropy bonus (0: not computed into the loss).
    gamma / lam: discount (GAE, REINFORCE++) and GAE lambda.
    kl_coef: weight of the per-token KL to the reference policy (the start value when
      `adaptive_kl`). 0 builds and runs no reference model at all.
    kl_estimator: registered name ("k1", "k2", "k3", ...; see `ppo/kl.py`).
    kl_in: where the KL acts: "reward" (PPO style: -kl_coef * kl_t shapes each token's
      reward before the advantages) or "loss" (GRPO style: + kl_coef * kl_t of the
      current policy, aggregated like the policy loss; use "k3").
    adaptive_kl / kl_target / kl_horizon: the proportional KL controller (kl_in="reward").
    kl_policy: whose KL the rewards penalise (kl_in="reward"): "behaviour" (the policy
      that sampled the rollout, as the inference stage measures it) or "proximal" (the
      trainer's actor as the update starts: the trainer re-derives rewards, advantages
      and returns; one more forward pass unless the loss is decoupled). They differ only
      for stale rollouts (`pipe` mode, runtime.max_staleness > 0), and not at all when
      the rewards hold no KL (kl_in="loss" or kl_coef=0: "proximal" then does nothing).
    target_kl: > 0 stops an update early: once a minibatch's approximate KL between the
      actor and the actor the update started from passes 1.5 x target_kl, that step and
      the update's remaining ones are not applied (`early_stop`, `gradient_steps` are
      logged); 0 = off.
    ptx_coef: > 0 adds `ptx_coef` times the SFT loss (the mean negative log-likelihood of
      demonstration completions, at temperature 1) to every actor gradient step, as
      InstructGPT's PPO-ptx mixes pretraining gradients into PPO: an anchor on what the
      policy learnt from demonstrations, for the answers PPO's own samples do not reach.
      The demonstrations are the SFT data (`PPOSystem(ptx_demos=...)`); 0 = off.
    ptx_batch_size: demonstrations per actor gradient step, drawn uniformly with
      replacement, a function of the seed and the PPO step only; they are split over the
      train stage's batch shards. 0: `minibatch_size` rounded up to a multiple of those
      shards (`ptx_rows_over`), so the default splits on every layout.
    whiten_advantages: normalise advantages per batch (estimators that define their own
      normalisation, like grpo, need it off).
    advantage_estimator: registered name: "gae" (needs a critic), or the critic-free
      "grpo", "rloo", "reinforce_pp" (see `ppo/critic_free.py`).
    group_size: completions sampled per prompt (n); a step takes batch_size / n prompts
      and its batch holds whole groups, contiguous.
    grpo_norm_by_std / grpo_eps: GRPO divides by the group's std + grpo_eps (False: only
      subtract the group mean, as Dr. GRPO).
    loss_agg: how per-token policy losses are aggregated: "token_mean",
      "seq_mean_token_mean" or "token_sum_norm" (see `ppo/aggregation.py`).
    loss_norm_len: the constant of "token_sum_norm" (0: the completion length).
    loss: registered policy loss ("ppo_clip", "decoupled_ppo_clip").
    behaviour_weight_cap: cap of the behaviour importance weight of the decoupled loss.
    reward_shift / reward_scale: each sequence's score enters the rewards as
      (score - reward_shift) / reward_scale (identity by default); the experiment pipeline
      sets them from the reward model's scores under the warm-start policy
      (`reward.normalize_samples`, `phases/reward_norm.py`) so that `kl_coef` weighs the
      same against every reward model. Reported scores (`reward/mean`) stay raw.
    max_bad_steps: stop after this many consecutive steps with a skipped (non-finite)
      update.
    seed: root of every random key of the system (generation, minibatch shuffles).
  """

  steps: int
  batch_size: int
  minibatch_size: int
  epochs: int = 1
  actor_lr: float = 1e-6
  critic_lr: float = 1e-5
  lr_schedule: str = "constant"
  warmup_steps: int = 0
  max_grad_norm: float = 1.0
  clip_eps: float = 0.2
  value_clip_eps: float = 0.2
  entropy_coef: float = 0.0
  gamma: float = 1.0
  lam: float = 0.95
  kl_coef: float = 0.05
  kl_estimator: str = "k1"
  kl_in: str = "reward"
  adaptive_kl: bool = False
  kl_target: float = 6.0
  kl_horizon: float = 10000
  kl_policy: str = "behaviour"
  target_kl: float = 0.0
  ptx_coef: float = 0.0
  ptx_batch_size: int = 0
  whiten_advantages: bool = True
  advantage_estimator: str = "gae"
  group_size: int = 1
  grpo_norm_by_std: bool = True
  grpo_eps: float = 1e-6
  loss_agg: str = "token_mean"
  loss_norm_len: int = 0
  loss: str = "ppo_clip"
  behaviour_weight_cap: float = 2.0
  reward_shift: float = 0.0
  reward_scale: float = 1.0
  max_bad_steps: int = 3
  seed: int = 0

  # Keys of an experiment config's `ppo` section that belong elsewhere: sampling
  # (SamplingParams) and the warm start of the critic (the experiment pipeline).
  _NOT_ALGORITHM = ("temperature", "top_k", "top_p", "critic_init")

  def __post_init__(self):
    # Importing ppo/ registers the built-in estimators and losses.
    from pipe_rlhf_jax.ppo import registry
    f = "ppo."
    check_int(self.steps, f + "steps")
    for name in ("batch_size", "minibatch_size", "epochs", "max_bad_steps"):
      check_int(getattr(self, name), f + name)
    check_int(self.warmup_steps, f + "warmup_steps", low=0)
    for name in ("actor_lr", "critic_lr", "max_grad_norm", "clip_eps", "value_clip_eps",
                 "kl_target", "kl_horizon", "behaviour_weight_cap", "reward_scale"):
      check_number(getattr(self, name), f + name)
    if (isinstance(self.reward_shift, bool) or not isinstance(self.reward_shift, (int, float))
        or not math.isfinite(self.reward_shift)):
      raise ValueError(f"ppo.reward_shift={self.reward_shift!r} must be a finite number.")
    check_int(self.ptx_batch_size, f + "ptx_batch_size", low=0)
    for name in ("kl_coef", "entropy_coef", "target_kl", "ptx_coef"):
      check_number(getattr(self, name), f + name, allow_zero=True)
    for name in ("gamma", "lam"):
      check_number(getattr(self, name), f + name, allow_zero=True, at_most=1.0)
    check_choice(self.lr_schedule, f + "lr_schedule", ("constant", "cosine"))
    check_choice(self.kl_estimator, f + "kl_estimator", registry.KL_ESTIMATORS.names())
    check_choice(self.advantage_estimator, f + "advantage_estimator",
                  registry.ADVANTAGE_ESTIMATORS.names())
    check_choice(self.loss, f + "loss", registry.POLICY_LOSSES.names())
    if self.batch_size % self.minibatch_size:
      raise ValueError(f"ppo.batch_size={self.batch_size} must be a multiple of "
                       f"ppo.minibatch_size={self.minibatch_size}.")
    self._check_algorithm(registry)

  def _check_algorithm(self, registry) -> None:
    """The checks of the estimator, group, KL placement and loss aggregation fields."""
    f = "ppo."
    check_int(self.group_size, f + "group_size")
    check_int(self.loss_norm_len, f + "loss_norm_len", low=0)
    check_number(self.grpo_eps, f + "grpo_eps")
    for name in ("grpo_norm_by_std", "whiten_advantages", "adaptive_kl"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{f}{name}={getattr(self, name)!r} must be True or False.")
    check_choice(self.kl_in, f + "kl_in", KL_PLACEMENTS)
    check_choice(self.kl_policy, f + "kl_policy", ("behaviour", "proximal"))
    check_choice(self.loss_agg, f + "loss_agg", registry.LOSS_AGGREGATIONS.names())
    # Groups are contiguous rows: a batch and every training minibatch hold whole groups
    # (minibatches are drawn group by group, so a group's advantages, which sum to zero
    # under grpo / rloo, enter the same gradient step).
    for name in ("batch_size", "minibatch_size"):
      if getattr(self, name) % self.group_size:
        raise ValueError(
            f"ppo.{name}={getattr(self, name)} must be a multiple of ppo.group_size="
            f"{self.group_size}: batches and minibatches hold whole groups of samples of "
            "one prompt.")
    info = registry.ADVANTAGE_ESTIMATORS.info(self.advantage_estimator)
    name = self.advantage_estimator
    if info["normalises"] and self.whiten_advantages:
      raise ValueError(
          f"ppo.whiten_advantages=True with ppo.advantage_estimator={name!r}, which "
          "normalises its advantages itself; set ppo.whiten_advantages=False.")
    if name in ("grpo", "rloo") and self.group_size < 2:
      raise ValueError(
          f"ppo.advantage_estimator={name!r} needs ppo.group_size >= 2 (its baseline is "
          f"the other samples of the same prompt), got {self.group_size}; raise it, or "
          "use 'reinforce_pp' for one sample per prompt.")
    if self.adaptive_kl and self.kl_in != "reward":
      raise ValueError("ppo.adaptive_kl=True adapts the KL coefficient of the reward; it "
                       "needs ppo.kl_in='reward' (or set ppo.adaptive_kl=False).")
    if self.adaptive_kl and self.kl_coef == 0:
      raise ValueError("ppo.adaptive_kl=True with ppo.kl_coef=0: the controller scales "
                       "the coefficient, so it would stay 0; give a positive start value.")

  @property
  def needs_critic(self) -> bool:
    """Whether the advantage estimator reads critic values (else no critic exists)."""
    from pipe_rlhf_jax.ppo import registry
    return registry.ADVANTAGE_ESTIMATORS.info(self.advantage_estimator)["needs_critic"]

  @property
  def needs_reference(self) -> bool:
    """Whether a reference policy is built and run (kl_coef > 0)."""
    return self.kl_coef > 0

  @property
  def ptx_rows(self) -> int:
    """Demonstrations per actor gradient step on one batch shard (0 without the SFT
    term); `ptx_rows_over` gives them on a layout."""
    return self.ptx_rows_over(1)

  def ptx_rows_over(self, batch_shards: int) -> int:
    """Demonstrations per actor gradient step on a train stage of `batch_shards` batch
    shards: `ptx_batch_size`, or by default `minibatch_size` rounded up to a multiple of
    the shards (0 without the SFT term)."""
    if not self.ptx_coef:
      return 0
    return self.ptx_batch_size or -(-self.minibatch_size // batch_shards) * batch_shards

  @property
  def prompts_per_step(self) -> int:
    """Prompts a PPO step takes from the prompt source: batch_size / group_size."""
    return self.batch_size // self.group_size

  def advantage_settings(self):
    """The static settings the advantage estimators read."""
    from pipe_rlhf_jax.ppo.advantages import AdvantageSettings
    return AdvantageSettings(gamma=self.gamma, lam=self.lam, group_size=self.group_size,
                             norm_by_std=self.grpo_norm_by_std, eps=self.grpo_eps)

  @classmethod
  def from_config(cls, ppo: Mapping[str, Any], seed: int = 0) -> "PPOConfig":
    """From an experiment config's `ppo` section; unknown keys are an error."""
    values = _plain(ppo)
    check_known(values, [f.name for f in dataclasses.fields(cls) if f.name != "seed"]
                + list(cls._NOT_ALGORITHM), "ppo")
    return cls(**{k: v for k, v in values.items() if k not in cls._NOT_ALGORITHM},
               seed=seed)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """Axis sizes of one mesh; -1 (at most one axis) takes the remaining devices."""

  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  pipe: int = 1

  @classmethod
  def from_config(cls, mesh: Mapping[str, Any], field: str) -> "MeshSpec":
    values = _plain(mesh)
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
    num_microbatches: micro-batches of the pipelined decoder (generation with pipe > 1).
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
      On a stage with a pipe axis the pipelined decoder runs S / num_microbatches rows
      per micro-batch and refills a micro-batch once all its rows are done (S a
      multiple of num_microbatches). Applies in every mode.
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
  pack_tokens: int = 0

  def __post_init__(self):
    from pipe_rlhf_jax.models.config import ATTENTION_IMPLS, REMAT_POLICIES
    check_choice(self.attention, "attention", ATTENTION_IMPLS)
    check_choice(self.remat, "remat", REMAT_POLICIES)
    check_int(self.logits_chunk, "logits_chunk", low=0)
    check_int(self.scan_unroll, "scan_unroll", low=0)
    check_int(self.num_slots, "num_slots", low=0)
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
    values = _plain(stage)
    check_known(values, ("mesh", "rules", "num_microbatches", "attention", "remat",
                         "logits_chunk", "scan_unroll", "num_slots", "pack_tokens"), field)
    rules = values.get("rules") or {}
    rules = tuple((name, tuple(a) if isinstance(a, list) else a)
                  for name, a in _plain(rules).items())
    try:
      return cls(mesh=MeshSpec.from_config(values.get("mesh", {}), field + ".mesh"),
                 rules=rules, num_microbatches=values.get("num_microbatches", 1),
                 attention=values.get("attention", "auto"),
                 remat=values.get("remat", "none"),
                 logits_chunk=values.get("logits_chunk", 0),
                 scan_unroll=values.get("scan_unroll", cls.scan_unroll),
                 num_slots=values.get("num_slots", 0),
                 pack_tokens=values.get("pack_tokens", 0))
    except ValueError as e:
      if str(e).startswith(("attention=", "remat=", "logits_chunk=", "scan_unroll=",
                            "num_slots=", "pack_tokens=")):
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
      (`runtime/progress.py`); 0 sizes it from the slowest step seen and the planner's
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
    check_choice(self.mode, "runtime.mode", MODES)
    check_int(self.max_staleness, "runtime.max_staleness", low=0)
    check_int(self.queue_size, "runtime.queue_size")
    if not isinstance(self.partial_rollouts, bool):
      raise ValueError(f"runtime.partial_rollouts={self.partial_rollouts!r} must be True "
                       "or False.")
    check_choice(self.past_staleness, "runtime.past_staleness", PAST_STALENESS)
    if self.partial_rollouts and (self.mode != "pipe" or not self.generate.num_slots):
      raise ValueError(
          f"runtime.partial_rollouts=True needs runtime.mode='pipe' and "
          f"stages.generate.num_slots > 0 (the slot engine keeps unfinished rows across "
          f"updates); got mode={self.mode!r}, num_slots={self.generate.num_slots}. Set "
          "both, or partial_rollouts=False.")
    check_number(self.shutdown_timeout_s, "runtime.shutdown_timeout_s")
    check_number(self.progress_timeout_s, "runtime.progress_timeout_s", allow_zero=True)
    if self.mode == "pipe":
      if self.placement is None or len(self.placement) != len(STAGES):
        raise ValueError(f"runtime.placement must give device counts for {STAGES} in "
                         f"pipe mode, got {self.placement}.")
      for stage, count in zip(STAGES, self.placement):
        check_int(count, f"runtime.placement.{stage}")
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
    pipelined = self.mode != "sequential" and self.generate.mesh.pipe > 1
    if self.generate.num_slots and pipelined:
      if self.partial_rollouts:
        raise ValueError(
            f"runtime.partial_rollouts=True with stages.generate.mesh.pipe="
            f"{self.generate.mesh.pipe}: the engine kept across updates is the plain "
            "decoder's; set stages.generate.mesh.pipe=1, or partial_rollouts=False.")
      if self.generate.num_slots % self.generate.num_microbatches:
        raise ValueError(
            f"stages.generate.num_slots={self.generate.num_slots} is not a multiple of "
            f"stages.generate.num_microbatches={self.generate.num_microbatches}: the "
            "pipelined decoder refills micro-batches of num_slots / num_microbatches rows.")
    if self.mode != "sequential" and self.train.mesh.pipe not in (1,):
      raise ValueError("stages.train.mesh.pipe must be 1: training keeps the layer stack "
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
    """From an experiment config's `runtime`, `mesh` and `stages` sections."""
    rt = _plain(config.runtime)
    placement = rt.get("placement")
    if placement is not None:
      placement = _plain(placement)
      if set(placement) != set(STAGES):
        raise ValueError(f"runtime.placement must give device counts for exactly "
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
    runtime: the plan (chosen by the planner, or the hand-written one it accepted).
    chosen: True when `runtime.plan = "auto"` chose it.
    predicted_step_s: the simulator's steady seconds per PPO step.
    bottleneck: the stage that bounds the step.
    memory_gib: predicted peak GiB per device, per device group.
    hardware: the profile's name.
    efficiency: where the efficiencies come from (a calibration file, or the defaults).
    search_s: seconds the search took (0 for a hand-written plan).
  """

  runtime: Plan
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
    return (f"plan ({how}): {self.runtime}; predicted {self.predicted_step_s:.4g} s/step "
            f"(bottleneck {self.bottleneck}; GiB/device {mem}) on {self.hardware}, "
            f"efficiencies: {self.efficiency}")
