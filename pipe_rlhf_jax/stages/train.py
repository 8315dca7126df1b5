"""The training stage: PPO epochs over minibatches for the actor and the critic.

One jitted call runs a whole PPO update (epochs x minibatches as nested `lax.scan`s), so
the host dispatches once per PPO step. Actor and critic have separate optax optimizers
and schedules. An update whose loss or gradients are not finite is skipped inside the
jitted function (parameters and optimizer state keep their old values) and counted; the
caller stops the run after `ppo.max_bad_steps` consecutive bad PPO steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from pipe_rlhf_jax.optim import apply_if_finite, optimizer_shardings
from pipe_rlhf_jax.ppo import losses
from pipe_rlhf_jax.ppo.advantages import masked_mean
from pipe_rlhf_jax.ppo.registry import POLICY_LOSSES
from pipe_rlhf_jax.ppo.types import Experience
from pipe_rlhf_jax.stages.common import (StageLayout, completion_logprobs,
                                         completion_values)


@struct.dataclass
class ActorCriticState:
  """Everything the trainer owns, as one pytree (checkpointed as is)."""

  actor: Any
  critic: Any
  actor_opt: Any
  critic_opt: Any
  step: jax.Array


@dataclasses.dataclass(frozen=True)
class PPOHyper:
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

  @classmethod
  def from_settings(cls, ppo, temperature: float) -> "PPOHyper":
    """From a `system.settings.PPOConfig` (or any object with its fields)."""
    return cls(epochs=ppo.epochs, minibatch_size=ppo.minibatch_size, clip_eps=ppo.clip_eps,
               value_clip_eps=ppo.value_clip_eps, entropy_coef=ppo.entropy_coef,
               loss=ppo.loss, behaviour_weight_cap=ppo.behaviour_weight_cap,
               temperature=temperature)


class TrainStage:
  """Builds and runs the jitted PPO update on the training mesh.

  Args:
    layout: the training stage's mesh and rules.
    actor_graphdef / critic_graphdef: static model structure (from `nnx.split`).
    hyper: PPO settings.
    actor_tx / critic_tx: their optimizers.
  """

  def __init__(self, layout: StageLayout, actor_graphdef: nnx.GraphDef,
               critic_graphdef: nnx.GraphDef, hyper: PPOHyper,
               actor_tx: optax.GradientTransformation,
               critic_tx: optax.GradientTransformation):
    self.layout = layout
    self.actor_graphdef = actor_graphdef
    self.critic_graphdef = critic_graphdef
    self.hyper = hyper
    self.actor_tx = actor_tx
    self.critic_tx = critic_tx
    POLICY_LOSSES.get(hyper.loss, field="ppo.loss")
    self._update = None
    self._state_shardings = None

  def state_shardings(self, actor: nnx.State, critic: nnx.State) -> ActorCriticState:
    """Shardings of the whole trainer state: optimizer moments follow their params."""
    actor_sh = self.layout.param_shardings(actor)
    critic_sh = self.layout.param_shardings(critic)
    replicated = self.layout.replicated
    return ActorCriticState(
        actor=actor_sh, critic=critic_sh,
        actor_opt=optimizer_shardings(self.actor_tx, actor, actor_sh, replicated),
        critic_opt=optimizer_shardings(self.critic_tx, critic, critic_sh, replicated),
        step=replicated)

  def init_state(self, actor: nnx.State, critic: nnx.State) -> ActorCriticState:
    """Places actor/critic on the training mesh and builds optimizer states there."""
    shardings = self.state_shardings(actor, critic)
    self._state_shardings = shardings

    def init(actor, critic):
      return ActorCriticState(actor=actor, critic=critic, actor_opt=self.actor_tx.init(actor),
                              critic_opt=self.critic_tx.init(critic),
                              step=jnp.zeros((), jnp.int32))

    # out_shardings makes the optimizer moments born in their final layout.
    init = jax.jit(init, out_shardings=shardings)
    actor = jax.device_put(actor, shardings.actor)
    critic = jax.device_put(critic, shardings.critic)
    return init(actor, critic)

  def _build_update(self, state: ActorCriticState):
    h = self.hyper
    actor_gd, critic_gd = self.actor_graphdef, self.critic_graphdef
    loss_fn = POLICY_LOSSES.get(h.loss)
    decoupled = h.loss == "decoupled_ppo_clip"
    layout = self.layout

    def minibatch_step(state: ActorCriticState, mb: dict):
      r = mb["rollout"]  # a Rollout whose arrays are [minibatch, ...]

      def actor_loss(actor):
        logprobs, entropy = completion_logprobs(
            actor_gd, actor, r.prompt_tokens, r.prompt_mask, r.completion_tokens,
            r.completion_mask, temperature=h.temperature, return_entropy=True)
        kwargs = {}
        if decoupled:
          kwargs = dict(behaviour_logprobs=r.behaviour_logprobs,
                        behaviour_weight_cap=h.behaviour_weight_cap)
        pg, aux = loss_fn(logprobs, mb["old_logprobs"], mb["advantages"],
                          r.completion_mask, clip_eps=h.clip_eps, **kwargs)
        ent = masked_mean(entropy, r.completion_mask)
        return pg - h.entropy_coef * ent, {**aux, "policy_loss": pg, "entropy": ent}

      def critic_loss(critic):
        values = completion_values(critic_gd, critic, r.prompt_tokens, r.prompt_mask,
                                   r.completion_tokens, r.completion_mask)
        loss, aux = losses.value_loss(values, mb["values"], mb["returns"], r.completion_mask,
                                      clip_eps=h.value_clip_eps)
        return loss, {**aux, "value_loss": loss}

      (a_loss, a_aux), a_grads = jax.value_and_grad(actor_loss, has_aux=True)(state.actor)
      (c_loss, c_aux), c_grads = jax.value_and_grad(critic_loss, has_aux=True)(state.critic)
      actor, actor_opt, a_ok = apply_if_finite(self.actor_tx, state.actor, state.actor_opt,
                                               a_grads, a_loss)
      critic, critic_opt, c_ok = apply_if_finite(self.critic_tx, state.critic,
                                                 state.critic_opt, c_grads, c_loss)
      metrics = {**a_aux, **c_aux, "actor_grad_norm": optax.tree.norm(a_grads),
                 "critic_grad_norm": optax.tree.norm(c_grads),
                 "bad_update": 1.0 - (a_ok & c_ok).astype(jnp.float32)}
      new = state.replace(actor=actor, critic=critic, actor_opt=actor_opt,
                          critic_opt=critic_opt)
      return new, metrics

    def update(state: ActorCriticState, exp: Experience, rng: jax.Array):
      with layout.rules_context():
        r = exp.rollout
        old_logprobs = exp.old_logprobs
        if decoupled:
          # The proximal policy is the trainer's current actor, which may be several
          # versions ahead of the behaviour policy that sampled the rollout.
          old_logprobs = completion_logprobs(
              actor_gd, state.actor, r.prompt_tokens, r.prompt_mask, r.completion_tokens,
              r.completion_mask, temperature=h.temperature)
        # Every leaf is [batch, ...] so minibatches can be gathered uniformly.
        per_sample = r.replace(policy_version=jnp.broadcast_to(r.policy_version, (
            r.prompt_tokens.shape[0],)))
        data = {"rollout": per_sample, "old_logprobs": old_logprobs,
                "advantages": exp.advantages, "values": exp.values, "returns": exp.returns}
        batch = r.prompt_tokens.shape[0]
        num_mb = batch // h.minibatch_size

        def epoch(state, epoch_rng):
          perm = jax.random.permutation(epoch_rng, batch)[:num_mb * h.minibatch_size]
          perm = perm.reshape(num_mb, h.minibatch_size)
          mbs = jax.tree.map(lambda x: x[perm], data)
          return jax.lax.scan(minibatch_step, state, mbs)

        state, metrics = jax.lax.scan(epoch, state, jax.random.split(rng, h.epochs))
        metrics = jax.tree.map(jnp.mean, metrics)
        metrics["bad_updates"] = metrics.pop("bad_update") * h.epochs * num_mb
        return state.replace(step=state.step + 1), metrics

    shardings = self._state_shardings or jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(update, donate_argnums=(0,),
                   out_shardings=(shardings, self.layout.replicated))

  def update(self, state: ActorCriticState, exp: Experience, rng: jax.Array
             ) -> tuple[ActorCriticState, dict]:
    """One PPO update on `exp` (already on the training mesh). Donates `state`."""
    if exp.rollout.prompt_tokens.shape[0] % self.hyper.minibatch_size:
      raise ValueError(
          f"ppo.batch_size={exp.rollout.prompt_tokens.shape[0]} is not a multiple of "
          f"ppo.minibatch_size={self.hyper.minibatch_size}.")
    if self._update is None:
      self._update = self._build_update(state)
    return self._update(state, exp, rng)
