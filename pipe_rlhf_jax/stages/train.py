"""The training stage: PPO epochs over minibatches for the actor and (if any) the critic.

One jitted call runs a whole PPO update (epochs x minibatches as nested `lax.scan`s), so
the host dispatches once per PPO step. Actor and critic have separate optax optimizers
and schedules; with a critic-free advantage estimator there is no critic, no critic
optimizer and no value loss (`ActorCriticState.critic` is None). An update whose loss or
gradients are not finite is skipped inside the jitted function (parameters and optimizer
state keep their old values) and counted; the caller stops the run after
`ppo.max_bad_steps` consecutive bad PPO steps.

With `ppo.kl_policy == "proximal"` the update first takes the rewards' KL penalty again at
its own actor (the proximal policy) and re-derives advantages and returns from it
(`stages.infer.derive_targets`), so stale rollouts are penalised for the KL of the policy
being trained rather than of the one that sampled them.

The objective itself is `ppo/objective.py` (pure functions; this stage runs the models
and keeps jit, shardings and donation): the actor loss is the policy surrogate, plus
`kl_coef` times the KL to the reference
when `ppo.kl_in == "loss"`, minus `entropy_coef` times the entropy, each aggregated over
tokens as `ppo.loss_agg` says, plus `ptx_coef` times the SFT loss on demonstrations
(PPO-ptx: the token-mean negative log-likelihood at temperature 1, as the SFT phase
computes it) when the caller passes a `PtxBatch` for the update. Minibatches are drawn
group by group (`ppo.group_size` contiguous rows), so a prompt's samples always share a
gradient step.

Packed training (`stages.train.pack_tokens` = L > 0): each minibatch's sequences (prompt
+ completion, real tokens only) are packed first-fit decreasing into rows of L tokens,
each sequence a segment of its own (`stages/packing.py`, the inference stage's packer),
and the actor's and critic's forward and backward passes run over those rows; the
per-token log-probs, entropies and values are read back into the padded `[minibatch, T]`
layout, so the objective (`ppo/objective.py`: every `ppo.loss_agg`, the KL and entropy
terms, the value loss) sees exactly the arrays of the padded path. The proximal pass
over the whole batch is packed too (a plan of its own); the PPO-ptx demonstrations stay
padded (a few rows of another batch).

Why packing happens within row-count minibatches, not minibatches formed by a token
budget: a minibatch is the unit the loss aggregates over (`token_mean` pools its tokens,
`seq_mean_*` its rows, a group estimator needs its `group_size` rows whole), so letting
a token budget pick the rows would change what each gradient step optimises, not only
how it is computed, and would make the minibatch count vary from batch to batch under a
scan that needs it fixed. Packing inside the same minibatches keeps the update
identical to the padded one (tests compare parameters and metrics) and still spends
compute on real tokens only.

Static shapes: the minibatch rows are drawn before the jitted update (`epoch_rows`, the
same keys and function as the padded path, so the same minibatches) and fetched with the
masks, one host transfer (a sync point the padded update does not have), and every
minibatch of the update is packed to one row count: the largest any of them needs, which
is one of `packing.round_rows`' few sizes an octave (rounded to the stage's batch
shards). One update is one shape, and a run compiles a handful of them, the way packed
inference does; a fixed worst case (a row per sequence) would be the padded cost again
whenever lengths vary. The LM head runs on the states that predict
real completion tokens only (`stages.common.packed_completion_logprobs`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from flax import nnx, struct
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np
import optax

from pipe_rlhf_jax.distributed.arrays import fetch, put_global
from pipe_rlhf_jax.models import lora
from pipe_rlhf_jax.optim import apply_if_finite, optimizer_shardings
from pipe_rlhf_jax.ppo import objective
from pipe_rlhf_jax.ppo.kl import kl_penalty
from pipe_rlhf_jax.ppo.registry import LOSS_AGGREGATIONS, POLICY_LOSSES
from pipe_rlhf_jax.ppo.types import Experience
from pipe_rlhf_jax.stages import packing
from pipe_rlhf_jax.stages.common import (
  StageLayout,
  completion_logprobs,
  completion_nll,
  completion_values,
  packed_completion_logprobs,
  packed_completion_values,
  policy_only,
)
from pipe_rlhf_jax.stages.infer import InferSettings, derive_targets


@struct.dataclass
class ActorCriticState:
  """Everything the trainer updates, as one pytree (checkpointed as is).

  `actor` and `critic` are the models' trainable parameters (`models.lora.split_trainable`):
  every parameter, or with LoRA adapters only the adapters (and the critic's value head),
  whose frozen base the stage keeps apart (`TrainStage.frozen`), never donated, moved
  or checkpointed with them; the optimizer states cover what is trained only.
  `critic` and `critic_opt` are None (no leaves) when the advantage estimator needs no
  critic, so nothing of a critic is placed, trained or checkpointed.
  """

  actor: Any
  critic: Any
  actor_opt: Any
  critic_opt: Any
  step: jax.Array


@struct.dataclass
class PtxBatch:
  """The demonstrations of one update's SFT term, one row block per gradient step.

  Every leaf is [epochs, minibatches, ptx_rows, ...] in the order the update's gradient
  steps run; prompts left-padded, completions right-padded with their mask through EOS
  (the `data.loaders.DemoLoader` layout).
  """

  prompt_tokens: jax.Array  # int32 [E, M, R, P]
  prompt_mask: jax.Array  # bool [E, M, R, P]
  completion_tokens: jax.Array  # int32 [E, M, R, T]
  completion_mask: jax.Array  # bool [E, M, R, T]


@dataclasses.dataclass(frozen=True)
class TrainSettings:
  """The static PPO settings the jitted update closes over.

  `temperature` defines the policy whose log-probs, ratios and entropy are optimised;
  top-k / top-p are deliberately absent: they filter the draw, never a log-prob (see
  `generation/sampling.py`).
  """

  epochs: int
  minibatch_size: int
  clip_eps: float
  value_clip_eps: float
  entropy_coef: float
  loss: str
  behaviour_weight_cap: float | None
  temperature: float
  group_size: int = 1
  loss_agg: str = "token_mean"
  loss_norm_len: int = 0
  kl_loss_coef: float = 0.0  # kl_coef when ppo.kl_in == "loss", else 0 (no KL loss)
  kl_estimator: str = "k3"
  # "proximal": the rewards' KL penalty is taken again at the trainer's actor as the
  # update starts, and the targets re-derived with `targets` (the inference stage's
  # settings); "behaviour": the experience is used as it arrives.
  kl_policy: str = "behaviour"
  targets: InferSettings | None = None
  target_kl: float = 0.0  # > 0: stop the update's remaining steps past 1.5 x this KL
  ptx_coef: float = 0.0  # > 0: + ptx_coef x the SFT loss on a PtxBatch each step
  ptx_rows: int = 0  # demonstrations per gradient step (0 without the SFT term)

  @property
  def proximal_pass(self) -> bool:
    """Whether the update starts with a forward pass of the actor over the whole batch
    (the proximal log-probs: for the decoupled loss, the rewards' KL or the early stop);
    the planner prices it (`planner.cost.train_terms`)."""
    return (self.loss == "decoupled_ppo_clip" or self.kl_policy == "proximal"
            or self.target_kl > 0)

  @classmethod
  def from_settings(cls, ppo, temperature: float) -> "TrainSettings":
    """From a `config.PPOSettings` (or any object with its fields).

    `kl_policy="proximal"` is kept only where the rewards hold a KL penalty: without
    one the re-derived targets would equal the inference stage's.
    """
    kl_policy = ppo.kl_policy
    if ppo.kl_in != "reward" or not ppo.kl_coef:
      kl_policy = "behaviour"
    return cls(epochs=ppo.epochs, minibatch_size=ppo.minibatch_size, clip_eps=ppo.clip_eps,
               value_clip_eps=ppo.value_clip_eps, entropy_coef=ppo.entropy_coef,
               loss=ppo.loss, behaviour_weight_cap=ppo.behaviour_weight_cap,
               temperature=temperature, group_size=ppo.group_size, loss_agg=ppo.loss_agg,
               loss_norm_len=ppo.loss_norm_len,
               kl_loss_coef=float(ppo.kl_coef) if ppo.kl_in == "loss" else 0.0,
               kl_estimator=ppo.kl_estimator, kl_policy=kl_policy,
               target_kl=float(ppo.target_kl), ptx_coef=float(ppo.ptx_coef),
               ptx_rows=ppo.ptx_rows,
               targets=(InferSettings.from_settings(ppo, temperature)
                        if kl_policy == "proximal" else None))


LOGPROB_GAP_KEYS = ("logprob_gap/max", "logprob_gap/mean")
PACK_FILL_KEY = "train/pack_fill"


def epoch_rows(epoch_rng: jax.Array, batch: int, h: TrainSettings) -> jax.Array:
  """The batch rows of each minibatch of one epoch, int [minibatches, minibatch_size].

  Whole groups are shuffled (rows [g * n, (g + 1) * n) stay together and in order); with
  n = 1 this is the per-sample permutation. Traced inside the padded update, called
  before the packed one: the same keys give the same minibatches either way.
  """
  n = h.group_size
  num_mb = batch // h.minibatch_size
  groups_per_mb = h.minibatch_size // n
  groups = jax.random.permutation(epoch_rng, batch // n)
  groups = groups[:num_mb * groups_per_mb].reshape(num_mb, groups_per_mb)
  return (groups[:, :, None] * n + jnp.arange(n)).reshape(num_mb, h.minibatch_size)


def logprob_gap(logprobs: jax.Array, behaviour_logprobs: jax.Array, mask: jax.Array
                ) -> dict[str, jax.Array]:
  """The largest and the mean |recomputed - behaviour| log-prob over the real tokens.

  Args:
    logprobs: f32 [batch, completion_len], the trainer's log-probs of the sampled tokens.
    behaviour_logprobs: f32 [batch, completion_len], those the sampler recorded.
    mask: bool [batch, completion_len], the completion's real tokens.

  Returns:
    {"logprob_gap/max", "logprob_gap/mean"} scalars (no gradient flows through them).
  """
  gap = jnp.where(mask, jnp.abs(jax.lax.stop_gradient(logprobs) - behaviour_logprobs), 0.0)
  count = jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0)
  return {"logprob_gap/max": jnp.max(gap), "logprob_gap/mean": jnp.sum(gap) / count}


@struct.dataclass
class Frozen:
  """The models' parameters the update reads but never changes (LoRA's base weights;
  empty states without adapters). `critic` is None without a critic."""

  actor: Any
  critic: Any


@dataclasses.dataclass(frozen=True)
class UpdateSpec:
  """What one PPO update's pure functions close over: the settings, the models'
  structures and the optimizers (static for the jitted update)."""

  settings: TrainSettings
  actor_graphdef: nnx.GraphDef
  critic_graphdef: nnx.GraphDef | None
  actor_tx: optax.GradientTransformation
  critic_tx: optax.GradientTransformation | None

  @property
  def has_critic(self) -> bool:
    return self.critic_graphdef is not None


def actor_loss(spec: UpdateSpec, mb: dict, actor: nnx.State) -> tuple[jax.Array, dict]:
  """The actor's loss on one minibatch (`objective.actor_objective`) and its metrics.

  `mb["rollout"]` is a Rollout of [minibatch, ...] arrays; `mb["plan"]` its PackPlan when
  training packed (the same [minibatch, T] log-probs, computed over the packed rows).
  """
  h, gd, r = spec.settings, spec.actor_graphdef, mb["rollout"]
  mask, plan = r.loss_mask, mb.get("plan")
  # Every completion token is attended (an episode's environment tokens too); the loss
  # reads the policy's tokens only.
  if plan is None:
    logprobs, entropy = completion_logprobs(
        gd, actor, r.prompt_tokens, r.prompt_mask, r.completion_tokens, r.completion_mask,
        temperature=h.temperature, return_entropy=True)
  else:
    logprobs, entropy = packed_completion_logprobs(
        gd, actor, plan, r.prompt_tokens, r.completion_tokens, r.completion_mask,
        temperature=h.temperature, return_entropy=True)
  logprobs, entropy = policy_only(r, logprobs), policy_only(r, entropy)
  ptx_nll = None
  if h.ptx_coef:
    d = mb["ptx"]
    ptx_nll = completion_nll(gd, actor, d.prompt_tokens, d.prompt_mask, d.completion_tokens,
                             d.completion_mask)
  loss, aux = objective.actor_objective(
      logprobs, entropy, mb["old_logprobs"], mb["advantages"], mask, h,
      behaviour_logprobs=r.behaviour_logprobs, start_logprobs=mb.get("start_logprobs"),
      ref_logprobs=mb.get("ref_logprobs"), ptx_nll=ptx_nll)
  return loss, {**aux, **logprob_gap(logprobs, r.behaviour_logprobs, mask)}


def critic_loss(spec: UpdateSpec, mb: dict, critic: nnx.State) -> tuple[jax.Array, dict]:
  """The critic's value loss on one minibatch (`objective.critic_objective`)."""
  gd, r, plan = spec.critic_graphdef, mb["rollout"], mb.get("plan")
  if plan is None:
    values = completion_values(gd, critic, r.prompt_tokens, r.prompt_mask,
                               r.completion_tokens, r.completion_mask)
  else:
    values = packed_completion_values(gd, critic, plan, r.prompt_tokens,
                                      r.completion_tokens, r.completion_mask)
  return objective.critic_objective(policy_only(r, values), mb["values"], mb["returns"],
                                    r.loss_mask, spec.settings)


def gradient_step(spec: UpdateSpec, frozen: Frozen, state: ActorCriticState, mb: dict
                  ) -> tuple[ActorCriticState, dict]:
  """One optimizer step of the actor (and critic) on a minibatch, skipped (and counted
  in `bad_update`) where the loss or gradients are not finite.

  Gradients are taken with respect to the trainable parameters only (`state`); the
  frozen ones (`frozen`) enter the loss as constants.
  """
  (a_loss, a_aux), a_grads = jax.value_and_grad(
      lambda actor: actor_loss(spec, mb, lora.merge(actor, frozen.actor)),
      has_aux=True)(state.actor)
  actor, actor_opt, ok, a_norm = apply_if_finite(
      spec.actor_tx, state.actor, state.actor_opt, a_grads, a_loss)
  metrics = {**a_aux, "actor_grad_norm": a_norm}
  new = state.replace(actor=actor, actor_opt=actor_opt)
  if spec.has_critic:
    (c_loss, c_aux), c_grads = jax.value_and_grad(
        lambda critic: critic_loss(spec, mb, lora.merge(critic, frozen.critic)),
        has_aux=True)(state.critic)
    critic, critic_opt, c_ok, c_norm = apply_if_finite(
        spec.critic_tx, state.critic, state.critic_opt, c_grads, c_loss)
    metrics.update(c_aux, critic_grad_norm=c_norm)
    new = new.replace(critic=critic, critic_opt=critic_opt)
    ok = ok & c_ok
  metrics["bad_update"] = 1.0 - ok.astype(jnp.float32)
  return new, metrics


def minibatch_step(spec: UpdateSpec, frozen: Frozen, carry, mb: dict):
  """One gradient step, or none once the update has stopped early (`target_kl`).

  The carry is (state, stopped); a stopped update skips the remaining steps' work
  (`lax.cond`), and the step whose starting KL passes 1.5 x target_kl is measured but
  not applied (the usual early stop). Metrics come with `ran`: 1 for the steps that were
  computed, whose means are reported.
  """
  state, stopped = carry
  target_kl = spec.settings.target_kl
  if not target_kl:
    new, metrics = gradient_step(spec, frozen, state, mb)
    return (new, stopped), {**metrics, "ran": jnp.ones((), jnp.float32)}

  def run(state):
    new, metrics = gradient_step(spec, frozen, state, mb)
    over = objective.early_stop(metrics["kl_from_start"], target_kl)
    new = jax.tree.map(lambda old, upd: jnp.where(over, old, upd), state, new)
    return new, metrics, over

  shapes = jax.eval_shape(lambda s: run(s)[1], state)

  def skip(state):
    return (state, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes),
            jnp.ones((), bool))

  new, metrics, over = jax.lax.cond(stopped, skip, run, state)
  ran = 1.0 - stopped.astype(jnp.float32)
  return (new, stopped | over), {**metrics, "ran": ran}


def proximal_pass(spec: UpdateSpec, frozen: Frozen, state: ActorCriticState,
                  exp: Experience, packed: dict | None
                  ) -> tuple[Experience, jax.Array, jax.Array, dict]:
  """The update's starting actor over the whole batch (the proximal policy), when the
  settings need it (`settings.proximal_pass`).

  Returns the experience (targets re-derived at the proximal policy under
  `kl_policy="proximal"`), the log-probs the ratio divides by (the proximal ones for the
  decoupled loss, else the behaviour ones), the proximal log-probs (None without the
  pass) and extra metrics.
  """
  h, r = spec.settings, exp.rollout
  if not h.proximal_pass:
    return exp, exp.old_logprobs, None, {}
  # The proximal policy is the trainer's actor as the update starts, which may be several
  # versions ahead of the behaviour policy that sampled the rollout.
  actor = lora.merge(state.actor, frozen.actor)
  if packed is None:
    prox = completion_logprobs(spec.actor_graphdef, actor, r.prompt_tokens,
                               r.prompt_mask, r.completion_tokens, r.completion_mask,
                               temperature=h.temperature)
  else:
    prox = packed_completion_logprobs(spec.actor_graphdef, actor, packed["whole"],
                                      r.prompt_tokens, r.completion_tokens,
                                      r.completion_mask, temperature=h.temperature)
  prox = policy_only(r, prox)
  old_logprobs = prox if h.loss == "decoupled_ppo_clip" else exp.old_logprobs
  extra = {}
  if h.kl_policy == "proximal":
    # The KL-regularised objective penalises the KL of the policy being optimised; the
    # behaviour policy's lags it by the rollout's staleness, a delayed restoring force
    # that lets full (decoupled) steps overshoot.
    exp = derive_targets(h.targets, r, prox, exp.ref_logprobs, exp.values, exp.scores,
                         exp.kl_coef)
  if exp.ref_logprobs is not None:
    # The rewards' KL term at the proximal policy, beside the behaviour policy's
    # `kl/mean`: on behaviour-sampled tokens, with k1, their difference estimates
    # KL(behaviour || proximal), how far the trainer has moved since sampling.
    kl = kl_penalty(prox, exp.ref_logprobs, r.loss_mask, h.kl_estimator)
    extra["kl_proximal/mean"] = jnp.mean(jnp.sum(kl, axis=1))
  return exp, old_logprobs, prox, extra


def update_fn(spec: UpdateSpec, state: ActorCriticState, frozen: Frozen, exp: Experience,
              rng: jax.Array, ptx: PtxBatch | None = None, packed: dict | None = None):
  """One PPO update: epochs x minibatches of `minibatch_step` as nested scans. Pure.

  `packed` (packed training only): "index" int [epochs, minibatches, minibatch], the rows
  of every minibatch (`epoch_rows` of this update's keys); "plans", their PackPlans with
  leading [epochs, minibatches]; "whole", the whole batch's plan for the proximal pass
  (None without one). None: the padded path.

  Returns the new state and the update's metrics (means over the gradient steps run).
  """
  h, r = spec.settings, exp.rollout
  exp, old_logprobs, prox_logprobs, extra = proximal_pass(spec, frozen, state, exp, packed)
  # Every leaf is [batch, ...] so minibatches can be gathered uniformly. (A batch of
  # partial rollouts carries a version per token already.)
  per_sample = r.replace(policy_version=jnp.broadcast_to(r.policy_version,
                                                         r.completion_tokens.shape))
  data = {"rollout": per_sample, "old_logprobs": old_logprobs,
          "advantages": exp.advantages}
  if spec.has_critic:
    data.update(values=exp.values, returns=exp.returns)
  if h.kl_loss_coef:
    data["ref_logprobs"] = exp.ref_logprobs
  if h.target_kl:
    data["start_logprobs"] = prox_logprobs
  batch = r.prompt_tokens.shape[0]
  index = plans = None
  if packed is not None:
    index, plans = packed["index"], packed["plans"]

  def epoch(carry, xs):
    epoch_rng, epoch_ptx, epoch_index, epoch_plans = xs
    # [M, minibatch]: drawn here on the padded path, before the update when packed.
    perm = epoch_rows(epoch_rng, batch, h) if epoch_index is None else epoch_index
    mbs = jax.tree.map(lambda x: x[perm], data)
    if epoch_ptx is not None:
      mbs["ptx"] = epoch_ptx  # leaves [M, R, ...]: one row block per step
    if epoch_plans is not None:
      mbs["plan"] = epoch_plans  # leaves [M, rows, L] / [M, minibatch, ...]
    return jax.lax.scan(functools.partial(minibatch_step, spec, frozen), carry, mbs)

  (state, stopped), metrics = jax.lax.scan(
      epoch, (state, jnp.zeros((), bool)),
      (jax.random.split(rng, h.epochs), ptx, index, plans))
  # The first gradient step's forward ran at the update's starting weights: its gap to
  # the behaviour log-probs is the sampler-trainer mismatch (plus the policy's drift when
  # the batch is stale), measured on one minibatch for free.
  gap = {k: metrics.pop(k)[0, 0] for k in LOGPROB_GAP_KEYS}
  if prox_logprobs is not None:  # the whole batch at the same weights, already computed
    gap = logprob_gap(prox_logprobs, r.behaviour_logprobs, r.loss_mask)
  # Means over the gradient steps that ran (all of them without target_kl).
  ran = metrics.pop("ran")
  metrics = jax.tree.map(lambda x: jnp.sum(x * ran) / jnp.sum(ran), metrics)
  metrics["bad_updates"] = metrics.pop("bad_update") * jnp.sum(ran)
  if h.target_kl:
    # Gradient steps taken: the ones that ran, less the one that stopped.
    metrics["early_stop"] = stopped.astype(jnp.float32)
    metrics["gradient_steps"] = jnp.sum(ran) - metrics["early_stop"]
  metrics.update(extra)
  metrics.update(gap)
  if plans is not None:
    # Real tokens over packed slots, all the update's minibatches together.
    metrics[PACK_FILL_KEY] = jnp.mean((plans.segment_ids != 0).astype(jnp.float32))
  return state.replace(step=state.step + 1), metrics


class TrainStage:
  """Builds and runs the jitted PPO update on the training mesh.

  Args:
    layout: the training stage's mesh and rules.
    actor_graphdef / critic_graphdef: static model structure (from `nnx.split`); the
      critic's is None when there is no critic.
    settings: the update's settings (`TrainSettings`).
    actor_tx / critic_tx: their optimizers (critic_tx None without a critic).
    pack_tokens: 0 runs the gradient steps over the padded layout; L > 0 over each
      minibatch packed into rows of L tokens (`stages.train.pack_tokens`; the same
      update).
  """

  def __init__(self, layout: StageLayout, actor_graphdef: nnx.GraphDef,
               critic_graphdef: nnx.GraphDef | None, settings: TrainSettings,
               actor_tx: optax.GradientTransformation,
               critic_tx: optax.GradientTransformation | None, pack_tokens: int = 0):
    if (critic_graphdef is None) != (critic_tx is None):
      raise ValueError("TrainStage: give both critic_graphdef and critic_tx (a critic) or "
                       "neither (a critic-free estimator).")
    if pack_tokens < 0:
      raise ValueError(f"stages.train.pack_tokens={pack_tokens} must be >= 0 (0: the "
                       "padded layout).")
    self.pack_tokens = pack_tokens
    self.layout = layout
    self.actor_graphdef = actor_graphdef
    self.critic_graphdef = critic_graphdef
    self.settings = settings
    self.actor_tx = actor_tx
    self.critic_tx = critic_tx
    POLICY_LOSSES.get(settings.loss, field="ppo.loss")
    LOSS_AGGREGATIONS.get(settings.loss_agg, field="ppo.loss_agg")
    self._update = None
    self._index = None
    self._state_shardings = None
    # The models' frozen parameters on this stage's mesh (`init_state`).
    self.frozen: Frozen | None = None

  @property
  def has_critic(self) -> bool:
    return self.critic_graphdef is not None

  def _check_critic(self, critic) -> None:
    if (critic is None) == self.has_critic:
      raise ValueError("TrainStage: pass critic parameters exactly when the stage was "
                       "built with a critic_graphdef.")

  def state_shardings(self, actor: nnx.State, critic: nnx.State | None = None
                      ) -> ActorCriticState:
    """Shardings of the trainer state of these trainable parameters (`ActorCriticState`):
    optimizer moments follow their params."""
    self._check_critic(critic)
    actor_sh = self.layout.param_shardings(actor)
    replicated = self.layout.replicated
    critic_sh = critic_opt_sh = None
    if critic is not None:
      critic_sh = self.layout.param_shardings(critic)
      critic_opt_sh = optimizer_shardings(self.critic_tx, critic, critic_sh, replicated)
    return ActorCriticState(
        actor=actor_sh, critic=critic_sh,
        actor_opt=optimizer_shardings(self.actor_tx, actor, actor_sh, replicated),
        critic_opt=critic_opt_sh, step=replicated)

  def init_state(self, actor: nnx.State, critic: nnx.State | None = None
                 ) -> ActorCriticState:
    """Places actor (and critic) on the training mesh and builds optimizer states there.

    `actor` and `critic` are whole models; their trainable parts
    (`models.lora.split_trainable`) become the state, the frozen parts `self.frozen`.
    """
    self._check_critic(critic)
    actor, frozen_actor = lora.split_trainable(actor)
    frozen_critic = None
    if critic is not None:
      critic, frozen_critic = lora.split_trainable(critic)
    self.frozen = Frozen(
        actor=self.layout.put_params(frozen_actor)[0],
        critic=None if critic is None else self.layout.put_params(frozen_critic)[0])
    shardings = self.state_shardings(actor, critic)
    self._state_shardings = shardings

    def init(actor, critic):
      return ActorCriticState(
          actor=actor, critic=critic, actor_opt=self.actor_tx.init(actor),
          critic_opt=None if critic is None else self.critic_tx.init(critic),
          step=jnp.zeros((), jnp.int32))

    # out_shardings makes the optimizer moments born in their final layout.
    init = jax.jit(init, out_shardings=shardings)
    actor = jax.device_put(actor, shardings.actor)
    if critic is not None:
      critic = jax.device_put(critic, shardings.critic)
    return init(actor, critic)

  def _build_update(self, state: ActorCriticState):
    spec = UpdateSpec(settings=self.settings, actor_graphdef=self.actor_graphdef,
                      critic_graphdef=self.critic_graphdef, actor_tx=self.actor_tx,
                      critic_tx=self.critic_tx)
    layout = self.layout

    def update(state, frozen, exp, rng, ptx=None, packed=None):
      with layout.rules_context():
        return update_fn(spec, state, frozen, exp, rng, ptx, packed)

    shardings = self._state_shardings or jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(update, donate_argnums=(0,),
                   out_shardings=(shardings, self.layout.replicated))

  def ptx_shape(self, batch: int) -> tuple[int, int, int]:
    """[epochs, minibatches, rows] of the `PtxBatch` an update of `batch` rollouts takes."""
    return (self.settings.epochs, batch // self.settings.minibatch_size, self.settings.ptx_rows)

  def update(self, state: ActorCriticState, exp: Experience, rng: jax.Array,
             ptx: PtxBatch | None = None) -> tuple[ActorCriticState, dict]:
    """One PPO update on `exp` (already on the training mesh). Donates `state`.

    `ptx`: the demonstrations of the SFT term, exactly when `settings.ptx_coef` > 0, with
    leading dims `ptx_shape(batch)`.
    """
    batch = exp.rollout.prompt_tokens.shape[0]
    if (ptx is None) != (not self.settings.ptx_coef):
      raise ValueError(f"TrainStage.update: ppo.ptx_coef={self.settings.ptx_coef} "
                       f"{'needs' if self.settings.ptx_coef else 'takes no'} demonstrations "
                       "(ptx); pass a PtxBatch exactly when ptx_coef > 0.")
    if ptx is not None and ptx.completion_tokens.shape[:3] != self.ptx_shape(batch):
      raise ValueError(f"TrainStage.update: ptx leaves are {ptx.completion_tokens.shape[:3]}"
                       f" [epochs, minibatches, rows]; this update needs "
                       f"{self.ptx_shape(batch)}.")
    if batch % self.settings.minibatch_size:
      raise ValueError(f"ppo.batch_size={batch} is not a multiple of "
                       f"ppo.minibatch_size={self.settings.minibatch_size}.")
    if self.settings.minibatch_size % self.settings.group_size:
      raise ValueError(f"ppo.minibatch_size={self.settings.minibatch_size} is not a multiple "
                       f"of ppo.group_size={self.settings.group_size}.")
    if self.settings.kl_loss_coef and exp.ref_logprobs is None:
      raise ValueError("ppo.kl_in='loss' needs reference log-probs in the experience; "
                       "the system must build the reference (ppo.kl_coef > 0).")
    if self._update is None:
      self._update = self._build_update(state)
    packed = self.pack(exp, rng) if self.pack_tokens else None
    return self._update(state, self.frozen, exp, rng, ptx, packed)

  def pack(self, exp: Experience, rng: jax.Array) -> dict:
    """The packed update's minibatch rows and plans for `exp` and `rng`, on this stage.

    One host transfer (the masks and the minibatch rows), then numpy planning: every
    minibatch packed to the row count the fullest one needs (`packing.plan_minibatches`),
    and the whole batch for the proximal pass when there is one.
    """
    h, layout = self.settings, self.layout
    batch = exp.rollout.prompt_tokens.shape[0]
    if self._index is None:
      self._index = jax.jit(
          lambda rng, batch: jax.vmap(lambda k: epoch_rows(k, batch, h))(
              jax.random.split(rng, h.epochs)), static_argnums=1)
    # [epochs, minibatches, minibatch]: a pure function of the key, so every process of
    # the stage draws the same rows (and the same as the padded update would).
    index = self._index(rng, batch)
    prompt_mask, completion_mask, index = fetch(
        (exp.rollout.prompt_mask, exp.rollout.completion_mask, index))
    ways = layout.batch_ways()
    field = "stages.train.pack_tokens"
    plans = packing.plan_minibatches(prompt_mask, completion_mask, index, self.pack_tokens,
                                     row_multiple=ways, field=field)
    whole = (packing.plan_packing(prompt_mask, completion_mask, self.pack_tokens,
                                  row_multiple=ways, field=field)
             if h.proximal_pass else None)
    # The plans' rows (and minibatch rows) split over the stage's batch shards, as a
    # padded minibatch's rows are; the leading [epochs, minibatches] stay whole.
    batch_axes = layout.batch_sharding(1).spec[0]

    def sharding(x):
      split = batch_axes if x.shape[2] % ways == 0 else None  # else replicated
      return NamedSharding(layout.mesh, PartitionSpec(None, None, split))

    return {"index": put_global(index.astype(np.int32), layout.replicated),
            "plans": put_global(plans, jax.tree.map(sharding, plans)),
            "whole": None if whole is None else layout.put_batch(whole)}
