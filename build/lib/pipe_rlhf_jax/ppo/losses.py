"""PPO training objectives: clipped policy surrogate, clipped value loss, entropy.

Owns the per-token losses the train stage differentiates, their diagnostics, and the
entropy of a distribution given by logits (the entropy bonus).
The policy loss is aggregated over tokens as `loss_agg` says (`ppo/aggregation.py`;
default a token mean over all valid tokens of the batch); the value loss and the
diagnostics are token means.

Policy losses registered in `POLICY_LOSSES` share one signature:
  fn(logprobs, old_logprobs, advantages, mask, *, clip_eps, behaviour_logprobs=None,
     behaviour_weight_cap=None, loss_agg="token_mean", loss_norm_len=0) -> (loss, aux)
"ppo_clip" is the standard PPO objective and ignores behaviour log-probs, so a caller
may always pass them; "decoupled_ppo_clip" requires them (Hilton et al. 2022).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pipe_rlhf_jax.ppo.advantages import (
  as_f32_mask,
  check_2d,
  masked_mean,
  masked_var,
)
from pipe_rlhf_jax.ppo.aggregation import aggregate
from pipe_rlhf_jax.ppo.registry import POLICY_LOSSES


def _masked_max(x: jax.Array, valid: jax.Array) -> jax.Array:
  """Max over valid positions, 0 when none is valid."""
  return jnp.where(jnp.any(valid), jnp.max(jnp.where(valid, x, -jnp.inf)), 0.0)


def _same_shape(ref_name: str, ref: jax.Array, **arrays: jax.Array) -> None:
  for name, x in arrays.items():
    if x.shape != ref.shape:
      raise ValueError(
          f"`{name}` has shape {x.shape} but `{ref_name}` has {ref.shape}; all "
          "per-token inputs must be [batch, length]."
      )


def policy_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_eps: float,
    behaviour_logprobs: jax.Array | None = None,
    behaviour_weight_cap: float | None = None,
    loss_agg: str = "token_mean",
    loss_norm_len: int = 0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """PPO clipped surrogate, optionally decoupled from the behaviour policy.

  Per token, with ratio r = exp(logprobs - old_logprobs):
    loss_t = max(-A_t * r, -A_t * clip(r, 1 - clip_eps, 1 + clip_eps))
  In the decoupled objective (Hilton et al. 2022, batch size-invariance), `old_logprobs`
  is the proximal policy and `behaviour_logprobs` the policy that sampled the tokens;
  each token's loss is multiplied by the constant importance weight
  w_t = exp(old_logprobs - behaviour_logprobs), capped above at `behaviour_weight_cap`.

  Args:
    logprobs: f32 [batch, length] current policy log-probs (differentiated).
    old_logprobs: f32 [batch, length] log-probs the ratio is taken against (constant).
    advantages: f32 [batch, length] advantages (constant).
    mask: bool/0-1 [batch, length], True on valid tokens.
    clip_eps: PPO clip range, > 0.
    behaviour_logprobs: f32 [batch, length] sampling-policy log-probs; None for plain
      PPO.
    behaviour_weight_cap: upper bound on w_t (None: uncapped); only with
      `behaviour_logprobs`.
    loss_agg: how per-token losses become the scalar (a `LOSS_AGGREGATIONS` name).
    loss_norm_len: the constant of "token_sum_norm" (0: the completion length).

  Returns:
    (loss scalar, aux) with aux scalars (token means whatever `loss_agg`):
      clip_frac: fraction of valid tokens on which the clipped branch is active.
      approx_kl: mean over valid tokens of (r - 1) - log r, the non-negative k3
        estimate of KL(old || current) from tokens sampled under the old policy.
      ratio_mean, ratio_max: of r over valid tokens.
      iw_mean, iw_max: of the uncapped weights w_t (decoupled only).
      iw_clip_frac: fraction of valid tokens whose w_t hit the cap (decoupled only).
  """
  if isinstance(clip_eps, (int, float)) and not clip_eps > 0:
    raise ValueError(f"`clip_eps` must be > 0, got {clip_eps}.")
  if behaviour_weight_cap is not None and behaviour_logprobs is None:
    raise ValueError(
        "`behaviour_weight_cap` was given without `behaviour_logprobs`; pass the "
        "behaviour log-probs or drop the cap."
    )
  logprobs = check_2d("logprobs", logprobs)
  old_logprobs = jax.lax.stop_gradient(check_2d("old_logprobs", old_logprobs))
  advantages = jax.lax.stop_gradient(check_2d("advantages", advantages))
  _same_shape("logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages)
  valid = as_f32_mask(mask, logprobs) > 0

  # Zero the log-ratio on padding before exp so garbage there cannot overflow or send
  # NaN gradients back through the `where`.
  log_ratio = jnp.where(valid, logprobs - old_logprobs, 0.0)  # [batch, length]
  ratio = jnp.exp(log_ratio)
  unclipped = -advantages * ratio
  clipped = -advantages * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
  per_token = jnp.maximum(unclipped, clipped)  # [batch, length]

  aux = {
      "clip_frac": masked_mean((clipped > unclipped).astype(jnp.float32), valid),
      "approx_kl": masked_mean(jnp.expm1(log_ratio) - log_ratio, valid),
      "ratio_mean": masked_mean(ratio, valid),
      "ratio_max": _masked_max(ratio, valid),
  }

  if behaviour_logprobs is not None:
    behaviour_logprobs = jax.lax.stop_gradient(
        check_2d("behaviour_logprobs", behaviour_logprobs)
    )
    _same_shape("logprobs", logprobs, behaviour_logprobs=behaviour_logprobs)
    weight = jnp.exp(jnp.where(valid, old_logprobs - behaviour_logprobs, 0.0))
    aux["iw_mean"] = masked_mean(weight, valid)
    aux["iw_max"] = _masked_max(weight, valid)
    if behaviour_weight_cap is not None:
      aux["iw_clip_frac"] = masked_mean(
          (weight > behaviour_weight_cap).astype(jnp.float32), valid
      )
      weight = jnp.minimum(weight, behaviour_weight_cap)
    else:
      aux["iw_clip_frac"] = jnp.zeros((), jnp.float32)
    per_token = per_token * weight

  return aggregate(per_token, valid, loss_agg, loss_norm_len), aux


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logprobs, old_logprobs, advantages, mask, *, clip_eps,
    behaviour_logprobs=None, behaviour_weight_cap=None, loss_agg="token_mean",
    loss_norm_len=0,
):
  """Standard PPO clipped surrogate; behaviour log-probs and cap are ignored."""
  del behaviour_logprobs, behaviour_weight_cap  # The ratio is against old_logprobs.
  return policy_loss(logprobs, old_logprobs, advantages, mask, clip_eps=clip_eps,
                     loss_agg=loss_agg, loss_norm_len=loss_norm_len)


@POLICY_LOSSES.register("decoupled_ppo_clip")
def decoupled_ppo_clip_loss(
    logprobs, old_logprobs, advantages, mask, *, clip_eps,
    behaviour_logprobs=None, behaviour_weight_cap=None, loss_agg="token_mean",
    loss_norm_len=0,
):
  """Decoupled PPO (proximal = `old_logprobs`); requires `behaviour_logprobs`."""
  if behaviour_logprobs is None:
    raise ValueError(
        "policy loss 'decoupled_ppo_clip' needs `behaviour_logprobs` (the sampling "
        "policy's log-probs); use 'ppo_clip' for on-policy training."
    )
  return policy_loss(
      logprobs, old_logprobs, advantages, mask, clip_eps=clip_eps,
      behaviour_logprobs=behaviour_logprobs,
      behaviour_weight_cap=behaviour_weight_cap, loss_agg=loss_agg,
      loss_norm_len=loss_norm_len,
  )


def explained_variance(
    values: jax.Array, returns: jax.Array, mask: jax.Array
) -> jax.Array:
  """1 - Var(returns - values) / Var(returns) over valid tokens.

  Args:
    values: f32 [batch, length] value predictions.
    returns: f32 [batch, length] value targets.
    mask: bool/0-1 [batch, length].

  Returns:
    Scalar float32; 1 is a perfect fit, <= 0 no better than a constant. Returns 0 when
    the returns have zero variance (the ratio is undefined there).
  """
  values = jnp.asarray(values, jnp.float32)
  returns = jnp.asarray(returns, jnp.float32)
  var_returns = masked_var(returns, mask)
  var_resid = masked_var(returns - values, mask)
  safe = jnp.where(var_returns > 0, var_returns, 1.0)
  return jnp.where(var_returns > 0, 1.0 - var_resid / safe, 0.0)


def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    *,
    clip_eps: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped value loss, token mean of 0.5 * max((v - R)^2, (v_clipped - R)^2).

  v_clipped = old_values + clip(values - old_values, -clip_eps, clip_eps) keeps the
  critic from moving further than `clip_eps` per update on tokens where that would
  lower the loss.

  Args:
    values: f32 [batch, length] current critic values (differentiated).
    old_values: f32 [batch, length] critic values at rollout time (constant).
    returns: f32 [batch, length] value targets (constant).
    mask: bool/0-1 [batch, length].
    clip_eps: value clip range, > 0.

  Returns:
    (loss scalar, aux) with aux scalars "value_clip_frac" (fraction of valid tokens on
    which the clipped term is the larger one) and "explained_variance" (of `values`).
  """
  if isinstance(clip_eps, (int, float)) and not clip_eps > 0:
    raise ValueError(f"value `clip_eps` must be > 0, got {clip_eps}.")
  values = check_2d("values", values)
  old_values = jax.lax.stop_gradient(check_2d("old_values", old_values))
  returns = jax.lax.stop_gradient(check_2d("returns", returns))
  _same_shape("values", values, old_values=old_values, returns=returns)
  valid = as_f32_mask(mask, values) > 0

  clipped_values = old_values + jnp.clip(values - old_values, -clip_eps, clip_eps)
  err_unclipped = jnp.square(values - returns)
  err_clipped = jnp.square(clipped_values - returns)
  per_token = 0.5 * jnp.maximum(err_unclipped, err_clipped)  # [batch, length]
  aux = {
      "value_clip_frac": masked_mean(
          (err_clipped > err_unclipped).astype(jnp.float32), valid
      ),
      "explained_variance": explained_variance(values, returns, valid),
  }
  return masked_mean(per_token, valid), aux


def entropy_from_logits(logits: jax.Array) -> jax.Array:
  """Per-position entropy of softmax(logits), in nats, computed in float32.

  Args:
    logits: [..., vocab] (any float dtype); -inf entries (excluded vocabulary) are
      allowed. Log-probs are valid logits of their own distribution.

  Returns:
    f32 [...]: one entropy per position (mask and average it at the call site).
  """
  return entropy_from_logprobs(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))


def entropy_from_logprobs(logprobs: jax.Array) -> jax.Array:
  """Per-position entropy, in nats, of a distribution given by its log-probs [..., vocab]
  (normalised, as `policy_logprobs` returns them): `entropy_from_logits` without the
  second log-softmax. -inf entries (excluded vocabulary) contribute 0."""
  logp = logprobs.astype(jnp.float32)
  kept = logp > -jnp.inf
  # The inner where keeps the gradient finite at -inf entries (0 * inf in the backward).
  safe = jnp.where(kept, logp, 0.0)
  return -jnp.sum(jnp.where(kept, jnp.exp(safe) * safe, 0.0), axis=-1)
