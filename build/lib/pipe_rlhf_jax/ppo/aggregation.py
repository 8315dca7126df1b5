"""Loss aggregation: how a per-token loss [batch, length] becomes the scalar that is minimised.

Owns the entries of `LOSS_AGGREGATIONS`, chosen by `ppo.loss_agg` and applied to every
policy-side term of the actor loss (clipped surrogate, KL-to-reference loss, entropy
bonus); the critic's value loss stays a token mean. Each entry is
  fn(per_token [batch, length], mask [batch, length], norm_len: int) -> f32 scalar
and ignores padded positions (their values may be garbage, even non-finite). `norm_len`
is `ppo.loss_norm_len`, read by token_sum_norm only; 0 there means `length`, the
completion length every rollout is padded to (a constant of the run).

  token_mean             sum of valid tokens / number of valid tokens. Every token of the
                         (mini)batch weighs the same, so long completions carry more of the
                         gradient. The PPO default (and DAPO's "token-level" loss).
  seq_mean_token_mean    mean over sequences (those with a valid token) of each
                         sequence's token mean: every completion weighs the same whatever
                         its length, so a token of a short completion weighs more. The
                         original GRPO objective (1/G sum_i 1/|o_i| sum_t).
  token_sum_norm         sum of valid tokens / (number of sequences * norm_len), norm_len a
                         constant (the completion length by default): a token's weight does
                         not depend on its own or any other sequence's length, which removes
                         the length bias of the two means (Dr. GRPO, Liu et al. 2025,
                         arXiv:2503.20783). Its scale is smaller than token_mean's by the
                         mean fill of the completions, so learning rates do not transfer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pipe_rlhf_jax.ppo.advantages import as_f32_mask, check_2d, masked_mean, masked_sum
from pipe_rlhf_jax.ppo.registry import LOSS_AGGREGATIONS


@LOSS_AGGREGATIONS.register("token_mean")
def token_mean(per_token: jax.Array, mask: jax.Array, norm_len: int) -> jax.Array:
  """Mean over every valid token of the batch (0 when there is none)."""
  del norm_len  # normalised by the token count
  return masked_mean(check_2d("per_token", per_token), mask)


@LOSS_AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(per_token: jax.Array, mask: jax.Array, norm_len: int) -> jax.Array:
  """Mean over non-empty sequences of their per-sequence token means."""
  del norm_len  # normalised by each sequence's own length
  per_token = check_2d("per_token", per_token)
  m = as_f32_mask(mask, per_token)
  per_seq = masked_mean(per_token, m, axis=1)  # [batch], 0 for an all-padding row
  nonempty = jnp.sum(m, axis=1) > 0  # [batch]
  return masked_mean(per_seq, nonempty)


@LOSS_AGGREGATIONS.register("token_sum_norm")
def token_sum_norm(per_token: jax.Array, mask: jax.Array, norm_len: int) -> jax.Array:
  """Sum over valid tokens divided by the constant batch rows x `norm_len`."""
  per_token = check_2d("per_token", per_token)
  if isinstance(norm_len, bool) or not isinstance(norm_len, int) or norm_len < 0:
    raise ValueError(f"ppo.loss_norm_len={norm_len!r} must be an integer >= 0 (0: the "
                     "completion length).")
  norm_len = norm_len or per_token.shape[1]
  return masked_sum(per_token, mask) / (per_token.shape[0] * norm_len)


def aggregate(per_token: jax.Array, mask: jax.Array, how: str = "token_mean",
              norm_len: int = 0) -> jax.Array:
  """Applies the aggregation named `how` (a `LOSS_AGGREGATIONS` entry, `ppo.loss_agg`)."""
  return LOSS_AGGREGATIONS.get(how, field="ppo.loss_agg")(per_token, mask, norm_len)
