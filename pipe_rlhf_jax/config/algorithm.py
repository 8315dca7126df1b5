"""The algorithm's settings: `PPOSettings`, the `ppo` section of an experiment config.

Every field is checked when a `PPOSettings` is constructed, and an error names the field
(with its config path, e.g. `ppo.clip_eps`) and what is allowed. The names of estimators,
losses and aggregations are checked against the algorithms' registries
(`ppo.registry`): importing it registers the built-in ones, and a name registered by a
user before the config is built is accepted the same way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from pipe_rlhf_jax.checks import check_choice, check_int, check_known, check_number, plain
from pipe_rlhf_jax.ppo import registry
from pipe_rlhf_jax.ppo.advantages import AdvantageSettings

KL_PLACEMENTS = ("reward", "loss")  # where the KL to the reference acts (ppo.kl_in)

@dataclasses.dataclass(frozen=True)
class PPOSettings:
  """The PPO algorithm: update sizes, optimisers, loss, KL penalty, advantages.

  Field names equal the keys of an experiment config's `ppo` section, so
  `PPOSettings.from_config(config.ppo)` is a plain copy (sampling keys excluded).

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
      for stale rollouts (`pipe` mode, plan.max_staleness > 0), and not at all when
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
      (score - reward_shift) / reward_scale (identity by default); the main job
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
  # (SamplingSettings) and the warm start of the critic (the experiment pipeline).
  _NOT_ALGORITHM = ("temperature", "top_k", "top_p", "critic_init")

  def __post_init__(self):
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
    self._check_algorithm()

  def _check_algorithm(self) -> None:
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
    return AdvantageSettings(gamma=self.gamma, lam=self.lam, group_size=self.group_size,
                             norm_by_std=self.grpo_norm_by_std, eps=self.grpo_eps)

  @classmethod
  def from_config(cls, ppo: Mapping[str, Any], seed: int = 0) -> "PPOSettings":
    """From an experiment config's `ppo` section; unknown keys are an error."""
    values = plain(ppo)
    check_known(values, [f.name for f in dataclasses.fields(cls) if f.name != "seed"]
                + list(cls._NOT_ALGORITHM), "ppo")
    return cls(**{k: v for k, v in values.items() if k not in cls._NOT_ALGORITHM},
               seed=seed)
