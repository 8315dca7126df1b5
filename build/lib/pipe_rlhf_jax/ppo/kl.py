"""KL regularisation against the frozen reference policy.

Owns the per-token KL(pi || ref) estimators (registered in `KL_ESTIMATORS`), the
KL-shaped per-token rewards fed to GAE, and the adaptive KL-coefficient controller.
The estimators take log-probs of the *sampled* tokens (tokens drawn from pi), so with
d = ref_logprob - logprob = log(ref / pi):
  k1 = -d                    unbiased, can be negative per token
  k2 = 0.5 * d^2             biased, non-negative, low variance
  k3 = exp(d) - d - 1        unbiased, non-negative (Schulman's "approximating KL")
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pipe_rlhf_jax.ppo.advantages import as_f32_mask, check_2d
from pipe_rlhf_jax.ppo.registry import KL_ESTIMATORS


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
  """Per-token k1 estimate: logp - ref_logp."""
  return jnp.asarray(logprobs, jnp.float32) - jnp.asarray(ref_logprobs, jnp.float32)


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
  """Per-token k2 estimate: 0.5 * (logp - ref_logp)^2."""
  return 0.5 * jnp.square(kl_k1(logprobs, ref_logprobs))


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
  """Per-token k3 estimate: exp(d) - d - 1 with d = ref_logp - logp; always >= 0."""
  d = jnp.asarray(ref_logprobs, jnp.float32) - jnp.asarray(logprobs, jnp.float32)
  # expm1 keeps precision for small d where exp(d) - 1 would cancel; the max guards the
  # last ulp so the estimate is never negative.
  return jnp.maximum(jnp.expm1(d) - d, 0.0)


def kl_penalty(
    logprobs: jax.Array, ref_logprobs: jax.Array, mask: jax.Array, estimator: str
) -> jax.Array:
  """Per-token KL(pi || ref) estimate over completion tokens.

  Args:
    logprobs: f32 [batch, length] log pi(token) of the sampled tokens.
    ref_logprobs: f32 [batch, length] log ref(token) of the same tokens.
    mask: bool/0-1 [batch, length], True on valid tokens.
    estimator: name in `KL_ESTIMATORS` ("k1", "k2", "k3").

  Returns:
    f32 [batch, length], 0 on padded positions.
  """
  fn = KL_ESTIMATORS.get(estimator, field="ppo.kl_estimator")
  logprobs = check_2d("logprobs", logprobs)
  ref_logprobs = check_2d("ref_logprobs", ref_logprobs)
  if logprobs.shape != ref_logprobs.shape:
    raise ValueError(
        f"`logprobs` {logprobs.shape} and `ref_logprobs` {ref_logprobs.shape} must "
        "have the same shape."
    )
  m = as_f32_mask(mask, logprobs) > 0
  # Feed zeros on padding so an overflowing estimate there (k3 of garbage) is neither
  # produced nor able to poison gradients through the `where`.
  kl = fn(jnp.where(m, logprobs, 0.0), jnp.where(m, ref_logprobs, 0.0))
  return jnp.where(m, kl, 0.0)


def last_valid_index(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Index of the last valid token per row and whether the row has any.

  Args:
    mask: bool/0-1 [batch, length].

  Returns:
    (index int32 [batch], has_valid bool [batch]); index is 0 for all-padding rows.
  """
  m = jnp.asarray(mask) > 0
  length = m.shape[-1]
  # argmax finds the first True of the reversed row, i.e. the last True of the row.
  idx = length - 1 - jnp.argmax(m[:, ::-1], axis=-1)
  has_valid = jnp.any(m, axis=-1)
  return jnp.where(has_valid, idx, 0).astype(jnp.int32), has_valid


def shape_rewards(
    scores: jax.Array, kl: jax.Array, mask: jax.Array, kl_coef: float | jax.Array
) -> jax.Array:
  """KL-shaped per-token rewards: -kl_coef * kl everywhere, plus the score at the end.

  Args:
    scores: f32 [batch] sequence-level score of each completion.
    kl: f32 [batch, length] per-token KL estimate (see `kl_penalty`).
    mask: bool/0-1 [batch, length], True on valid tokens.
    kl_coef: scalar KL coefficient (Python float or traced scalar).

  Returns:
    f32 [batch, length]; the score lands on each row's last valid token, rows with no
    valid token get 0 everywhere.
  """
  kl = check_2d("kl", kl)
  m = as_f32_mask(mask, kl) > 0
  scores = jnp.asarray(scores, jnp.float32)
  if scores.shape != kl.shape[:1]:
    raise ValueError(
        f"`scores` must be [batch] = {kl.shape[:1]}, got {scores.shape}; pass one "
        "scalar score per completion."
    )
  rewards = jnp.where(m, -jnp.asarray(kl_coef, jnp.float32) * kl, 0.0)
  idx, has_valid = last_valid_index(m)
  at_end = jax.nn.one_hot(idx, kl.shape[1], dtype=jnp.float32)  # [batch, length]
  at_end = at_end * has_valid[:, None]
  return rewards + scores[:, None] * at_end


def adaptive_kl_coef(coef, current_kl, num_steps, target, horizon):
  """Proportional KL-coefficient controller of Ziegler et al. (2019).

  error = clip(current_kl / target - 1, -0.2, 0.2)
  new_coef = coef * (1 + error * num_steps / horizon)
  The coefficient grows when the observed KL exceeds the target and shrinks below it.

  Args:
    coef: current KL coefficient.
    current_kl: observed KL (e.g. mean per-sequence KL of the last batch).
    num_steps: samples (or steps) consumed since the last update.
    target: KL target, > 0.
    horizon: controller horizon in the same unit as `num_steps`, > 0.

  Returns:
    The new coefficient: a Python float when every input is a host number, otherwise a
    float32 jax scalar (safe under jit).
  """
  args = (coef, current_kl, num_steps, target, horizon)
  if any(isinstance(a, jax.Array) for a in args):
    coef, current_kl, num_steps, target, horizon = (
        jnp.asarray(a, jnp.float32) for a in args
    )
    error = jnp.clip(current_kl / target - 1.0, -0.2, 0.2)
    return coef * (1.0 + error * num_steps / horizon)
  if not float(target) > 0:
    raise ValueError(f"KL `target` must be > 0, got {target}.")
  if not float(horizon) > 0:
    raise ValueError(f"KL controller `horizon` must be > 0, got {horizon}.")
  error = float(np.clip(float(current_kl) / float(target) - 1.0, -0.2, 0.2))
  return float(coef) * (1.0 + error * float(num_steps) / float(horizon))
