"""The PPO objective of one gradient step: the actor's and the critic's loss, as pure functions.

Owns how the terms the train stage minimises are combined and which metrics they report:
the actor loss is the policy surrogate (a `POLICY_LOSSES` entry, `ppo/losses.py`), minus
`entropy_coef` times the entropy, plus `ptx_coef` times the SFT loss on demonstrations
(PPO-ptx), plus `kl_loss_coef` times the KL to the reference (`ppo.kl_in == "loss"`); the
policy-side terms are aggregated over tokens as `loss_agg` says (`ppo/aggregation.py`).
It also owns the early-stop signal: the KL the update has moved the policy from where it
started (`kl_from_start`) and the test of it against `target_kl` (`early_stop`).

No model runs here: the stage computes log-probs, entropies, values and the SFT
negative log-likelihood with its models (under jit, shardings, donation and remat) and
passes them in, so each term can be checked on small hand-built arrays.

`settings` is any object with the fields of `stages.train.TrainSettings` that a function reads
(the stage passes its `TrainSettings`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pipe_rlhf_jax.ppo import losses
from pipe_rlhf_jax.ppo.advantages import masked_mean
from pipe_rlhf_jax.ppo.aggregation import aggregate
from pipe_rlhf_jax.ppo.kl import kl_penalty
from pipe_rlhf_jax.ppo.registry import POLICY_LOSSES

# A step whose starting KL passes this multiple of `target_kl` is not applied, and the
# update's remaining steps are skipped (the usual PPO early stop).
EARLY_STOP_FACTOR = 1.5


def kl_from_start(logprobs: jax.Array, start_logprobs: jax.Array,
                  mask: jax.Array) -> jax.Array:
  """How far the update has moved the policy so far, a token mean of (r - 1) - log r.

  The same estimator as the surrogate's `approx_kl`, but against the actor the update
  started from, so stale rollouts' own distance from it does not count.

  Args:
    logprobs: f32 [batch, length] current policy log-probs.
    start_logprobs: f32 [batch, length] log-probs of the actor as the update started.
    mask: bool [batch, length], True on valid tokens.
  """
  # Zeroed on padding before expm1 so garbage there cannot overflow.
  log_ratio = jnp.where(mask, logprobs - start_logprobs, 0.0)  # [batch, length]
  return masked_mean(jnp.expm1(log_ratio) - log_ratio, mask)


def early_stop(kl: jax.Array, target_kl: float) -> jax.Array:
  """bool scalar: whether a step that starts `kl` (`kl_from_start`) from the update's
  start passes `EARLY_STOP_FACTOR` x `target_kl`, so it and the rest are not applied."""
  return kl > EARLY_STOP_FACTOR * target_kl


def actor_objective(
    logprobs: jax.Array,
    entropy: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    settings: Any,
    *,
    behaviour_logprobs: jax.Array | None = None,
    start_logprobs: jax.Array | None = None,
    ref_logprobs: jax.Array | None = None,
    ptx_nll: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The actor's loss of one minibatch and its metrics.

  Args:
    logprobs: f32 [batch, length] current policy log-probs of the sampled tokens
      (differentiated), at `settings.temperature`.
    entropy: f32 [batch, length] the current policy's entropy at each position.
    old_logprobs: f32 [batch, length] log-probs the ratio is taken against (the
      behaviour policy's, or the proximal one's for the decoupled loss).
    advantages: f32 [batch, length].
    mask: bool [batch, length], True on valid completion tokens.
    settings: reads loss, clip_eps, behaviour_weight_cap, loss_agg, loss_norm_len,
      entropy_coef, target_kl, ptx_coef, kl_loss_coef, kl_estimator.
    behaviour_logprobs: f32 [batch, length] of the sampling policy; read by
      "decoupled_ppo_clip" only.
    start_logprobs: f32 [batch, length] of the actor as the update started; needed when
      `settings.target_kl` > 0 (the early-stop signal).
    ref_logprobs: f32 [batch, length] of the reference; needed when
      `settings.kl_loss_coef` > 0.
    ptx_nll: f32 scalar, the token-mean SFT negative log-likelihood of the step's
      demonstrations; needed when `settings.ptx_coef` > 0.

  Returns:
    (loss scalar, metrics): the policy loss's aux (`ppo/losses.py`) plus "policy_loss",
    "entropy" (a token mean), and "kl_from_start", "ptx_loss", "kl_loss" when their
    settings are on.
  """
  s = settings
  agg = lambda per_token: aggregate(per_token, mask, s.loss_agg, s.loss_norm_len)
  kwargs = {}
  if s.loss == "decoupled_ppo_clip":
    kwargs = dict(behaviour_logprobs=behaviour_logprobs,
                  behaviour_weight_cap=s.behaviour_weight_cap)
  pg, aux = POLICY_LOSSES.get(s.loss)(logprobs, old_logprobs, advantages, mask,
                                      clip_eps=s.clip_eps, loss_agg=s.loss_agg,
                                      loss_norm_len=s.loss_norm_len, **kwargs)
  # The entropy bonus is skipped entirely at coefficient 0, so it adds no op to the graph.
  total = pg - s.entropy_coef * agg(entropy) if s.entropy_coef else pg
  # The reported entropy is a token mean whatever ppo.loss_agg, so runs compare.
  aux = {**aux, "policy_loss": pg, "entropy": masked_mean(entropy, mask)}
  if s.target_kl:
    aux["kl_from_start"] = kl_from_start(logprobs, start_logprobs, mask)
  if s.ptx_coef:
    # PPO-ptx: the SFT objective on demonstrations, so that the answers PPO's own
    # samples never visit keep what SFT taught them while the parameters move.
    total = total + s.ptx_coef * ptx_nll
    aux["ptx_loss"] = ptx_nll
  if s.kl_loss_coef:
    # GRPO-style KL term: of the *current* policy to the reference, on the sampled
    # tokens (k3: unbiased and >= 0, with a gradient that pulls towards the
    # reference); no importance weight, as in GRPO, even for stale rollouts.
    kl = agg(kl_penalty(logprobs, ref_logprobs, mask, s.kl_estimator))
    total = total + s.kl_loss_coef * kl
    aux["kl_loss"] = kl
  return total, aux


def critic_objective(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    settings: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The critic's loss of one minibatch (the clipped value loss, a token mean whatever
  `loss_agg`) and its metrics: `losses.value_loss`'s aux plus "value_loss".

  Args:
    values: f32 [batch, length] current critic values (differentiated).
    old_values: f32 [batch, length] critic values at rollout time.
    returns: f32 [batch, length] value targets.
    mask: bool [batch, length], True on valid completion tokens.
    settings: reads value_clip_eps.
  """
  loss, aux = losses.value_loss(values, old_values, returns, mask,
                                clip_eps=settings.value_clip_eps)
  return loss, {**aux, "value_loss": loss}
