"""Masked statistics, whitening, GAE, and the calling convention of advantage estimators.

Owns the per-token credit assignment of PPO over completion tokens. Every array is
`[batch, length]` with a 0/1 (or boolean) `mask` of the valid tokens: a prefix of
each row for one turn, the policy's turns of a multi-turn episode (the environment's
tokens between them are invalid: GAE steps over them); rows may be entirely padding.
Invalid positions never contribute to a statistic and always come out as 0. All
functions are pure, jit-able and compute in float32.

Every entry of `ADVANTAGE_ESTIMATORS` is called as
  fn(rewards, values, mask, settings: AdvantageSettings) -> (advantages, returns)
with per-token `rewards` [batch, length] (the score on each row's last valid token, plus
the KL shaping when `ppo.kl_in == "reward"`), critic `values` [batch, length] (None for an
entry registered with `needs_critic=False`) and the static `settings`. The critic-free
estimators (GRPO, RLOO, REINFORCE++) live in `ppo/critic_free.py`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pipe_rlhf_jax.ppo.registry import ADVANTAGE_ESTIMATORS


@dataclasses.dataclass(frozen=True)
class AdvantageSettings:
  """The static settings an advantage estimator may read (from `PPOSettings`).

  Attributes:
    gamma: discount (GAE, REINFORCE++).
    lam: GAE lambda.
    group_size: completions per prompt; rows [g * n, (g + 1) * n) of a batch are the
      samples of prompt g (group estimators).
    norm_by_std: GRPO divides by the group's standard deviation (False: Dr. GRPO).
    eps: added to the group standard deviation before dividing (GRPO).
  """

  gamma: float = 1.0
  lam: float = 0.95
  group_size: int = 1
  norm_by_std: bool = True
  eps: float = 1e-6


def as_f32_mask(mask: jax.Array, like: jax.Array, name: str = "mask") -> jax.Array:
  """Checks `mask` has the shape of `like` and returns it as float32 0/1."""
  mask = jnp.asarray(mask)
  if mask.shape != jnp.shape(like):
    raise ValueError(
        f"`{name}` has shape {mask.shape} but the data has shape {jnp.shape(like)}; "
        "pass one mask entry per token."
    )
  return mask.astype(jnp.float32)


def check_2d(name: str, x: jax.Array) -> jax.Array:
  x = jnp.asarray(x, jnp.float32)
  if x.ndim != 2:
    raise ValueError(
        f"`{name}` must be [batch, length], got shape {x.shape}; add a batch axis "
        "or flatten extra leading axes."
    )
  return x


def masked_sum(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """Sum of `x` over the positions where `mask` is set.

  Uses `where` rather than a product so that non-finite values on padding (for example
  `inf` log-ratios) cannot leak into the result.
  """
  x = jnp.asarray(x, jnp.float32)
  m = as_f32_mask(mask, x)
  return jnp.sum(jnp.where(m > 0, x, 0.0), axis=axis)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """Mean of `x` over valid positions.

  Args:
    x: values, any shape.
    mask: same shape as `x`, True/1 on valid positions.
    axis: axis or axes to reduce (None: all).

  Returns:
    The masked mean, float32; 0 where no position is valid (an all-padding row or batch).
  """
  x = jnp.asarray(x, jnp.float32)
  m = as_f32_mask(mask, x)
  count = jnp.sum(m, axis=axis)
  return masked_sum(x, m, axis=axis) / jnp.maximum(count, 1.0)


def masked_var(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Population (biased, divide-by-N) variance of `x` over all valid positions.

  Args:
    x: values, any shape.
    mask: same shape as `x`, True/1 on valid positions.

  Returns:
    Scalar float32 variance; 0 when no position is valid.
  """
  x = jnp.asarray(x, jnp.float32)
  mean = masked_mean(x, mask)
  return masked_mean(jnp.square(x - mean), mask)


def whiten(
    x: jax.Array, mask: jax.Array, shift_mean: bool = True, eps: float = 1e-8
) -> jax.Array:
  """Normalises `x` to unit variance (and zero mean) using valid positions only.

  Args:
    x: values, any shape (typically advantages [batch, length]).
    mask: same shape, True/1 on valid positions.
    shift_mean: if False, the mean is kept (only the scale changes), which some PPO
      variants use for advantages that must keep their sign balance.
    eps: added to the variance before the square root.

  Returns:
    float32 array shaped like `x`, 0 on padded positions.
  """
  x = jnp.asarray(x, jnp.float32)
  m = as_f32_mask(mask, x)
  mean = masked_mean(x, m)
  var = masked_var(x, m)
  out = (x - mean) * jax.lax.rsqrt(var + eps)
  if not shift_mean:
    out = out + mean
  return jnp.where(m > 0, out, 0.0)


def gae(
    rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    gamma: float | jax.Array,
    lam: float | jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """Generalised advantage estimation (Schulman et al. 2016) over completion tokens.

  The trajectory is a row's valid tokens in order; invalid positions between them (an
  episode's environment tokens) are skipped, not steps: the next state of a valid token
  is the next valid token, wherever it sits. With t+ the next valid position after t
  (none past the row's last valid token, where the value bootstrapped is 0):
    delta_t = r_t + gamma * V_{t+} - V_t
    A_t     = delta_t + gamma * lam * A_{t+}
    R_t     = A_t + V_t
  For a mask that is a prefix of each row (one turn) t+ = t + 1. Invalid positions
  neither contribute nor receive advantage. Output is not whitened; call `whiten`.

  Args:
    rewards: f32 [batch, length] per-token rewards.
    values: f32 [batch, length] critic values V(s_t).
    mask: bool/0-1 [batch, length], True on valid (policy) tokens.
    gamma: discount (Python float or traced scalar).
    lam: GAE lambda (Python float or traced scalar).

  Returns:
    (advantages, returns), each f32 [batch, length], 0 on invalid positions.
  """
  rewards = check_2d("rewards", rewards)
  values = check_2d("values", values)
  if rewards.shape != values.shape:
    raise ValueError(
        f"`rewards` {rewards.shape} and `values` {values.shape} must have the same "
        "[batch, length] shape."
    )
  m = as_f32_mask(mask, rewards)
  gamma = jnp.asarray(gamma, jnp.float32)
  lam = jnp.asarray(lam, jnp.float32)

  # Zero out padding first so garbage there (e.g. values of pad tokens) cannot leak.
  rewards = jnp.where(m > 0, rewards, 0.0)
  values = jnp.where(m > 0, values, 0.0)

  def step(carry, inputs):
    # carry: (V, A) of the next valid position, (0, 0) past the last; an invalid
    # position passes it through unchanged.
    next_value, next_adv = carry  # [batch] each
    r_t, v_t, valid = inputs  # [batch] each
    adv_t = r_t + gamma * next_value - v_t + gamma * lam * next_adv
    carry = (jnp.where(valid, v_t, next_value), jnp.where(valid, adv_t, next_adv))
    return carry, jnp.where(valid, adv_t, 0.0)

  init = (jnp.zeros(rewards.shape[:1], jnp.float32),) * 2  # [batch] each
  # Scan runs over time, so feed [length, batch] and walk it backwards.
  _, adv_tb = jax.lax.scan(step, init, (rewards.T, values.T, (m > 0).T), reverse=True)
  advantages = adv_tb.T  # [batch, length]
  returns = (advantages + values) * m
  return advantages, returns


@ADVANTAGE_ESTIMATORS.register("gae", needs_critic=True)
def gae_estimator(rewards: jax.Array, values: jax.Array, mask: jax.Array,
                  settings: AdvantageSettings) -> tuple[jax.Array, jax.Array]:
  """`gae` under the registry's calling convention (needs the critic's values)."""
  if values is None:
    raise ValueError("advantage estimator 'gae' needs critic values; build the system "
                     "with a critic.")
  return gae(rewards, values, mask, settings.gamma, settings.lam)
