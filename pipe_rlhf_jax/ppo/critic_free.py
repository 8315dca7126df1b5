"""Critic-free advantage estimators: GRPO, RLOO and REINFORCE++.

Owns the estimators that replace the critic's value baseline by statistics of the batch:
of the other completions of the same prompt (GRPO, RLOO) or of the whole batch
(REINFORCE++). They are registered with `needs_critic=False`, so a system using them
builds, trains, syncs and checkpoints no critic (`values` is None here).

Groups: with `settings.group_size = n`, rows [g * n, (g + 1) * n) of the batch are the n
completions of prompt g (the generation stage lays them out so; `PPOSettings` checks that
the batch holds whole groups). The sequence return of row i is the sum of its per-token
rewards, R_i = score_i (minus the KL shaping when `ppo.kl_in == "reward"`). Definitions
follow the published algorithms as verl (`verl/trainer/ppo/core_algos.py`) and OpenRLHF
implement them:

  grpo          A_i = (R_i - mean_g R) / (std_g R + eps), std with Bessel's correction
                (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300); with
                `norm_by_std=False`, A_i = R_i - mean_g R (Liu et al. 2025, Dr. GRPO,
                arXiv:2503.20783).
  rloo          A_i = R_i - (sum_g R - R_i) / (n - 1): the mean of the group's *other*
                samples as baseline (Ahmadian et al. 2024, arXiv:2402.14740).
  reinforce_pp  G_t = sum_{k >= t} gamma^(k - t) r_k per token (the KL penalty inside
                r_k when `kl_in == "reward"`), then A = whiten(G) over every valid token of
                the batch (Hu 2025, REINFORCE++, arXiv:2501.03262).

A sequence-level advantage is the same on every valid token of its row. A group of one
sample has no baseline: GRPO and RLOO then return R_i unchanged (verl's convention);
`PPOSettings` refuses `group_size = 1` for them, since that is REINFORCE without baseline.
Every function returns (advantages, returns), both 0 on padding; `returns` is the
undiscounted sequence return R_i on every valid token (GRPO, RLOO) or G_t (REINFORCE++).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pipe_rlhf_jax.ppo.advantages import AdvantageSettings, check_2d, gae, masked_sum, whiten
from pipe_rlhf_jax.ppo.registry import ADVANTAGE_ESTIMATORS


def sequence_returns(rewards: jax.Array, mask: jax.Array) -> jax.Array:
  """R_i: the sum of each row's per-token rewards over valid tokens. f32 [batch]."""
  rewards = check_2d("rewards", rewards)
  return masked_sum(rewards, mask, axis=1)


def grouped(x: jax.Array, group_size: int) -> jax.Array:
  """[batch] -> [batch // group_size, group_size], rows of one prompt together."""
  if group_size < 1 or x.shape[0] % group_size:
    raise ValueError(
        f"a batch of {x.shape[0]} completions does not split into groups of "
        f"ppo.group_size={group_size}; make ppo.batch_size a multiple of it.")
  return x.reshape(x.shape[0] // group_size, group_size)


def _per_token(seq_values: jax.Array, mask: jax.Array) -> jax.Array:
  """A [batch] value on every valid token of its row: [batch, length], 0 on padding."""
  return jnp.where(jnp.asarray(mask) > 0, seq_values[:, None], 0.0)


def group_normalised(returns: jax.Array, group_size: int, *, norm_by_std: bool = True,
                     eps: float = 1e-6) -> jax.Array:
  """GRPO's sequence advantages (R - mean_g) / (std_g + eps), or R - mean_g.

  Args:
    returns: f32 [batch] sequence returns, groups contiguous.
    group_size: n, samples per prompt.
    norm_by_std: divide by the group's sample standard deviation (ddof = 1).
    eps: keeps a group of equal returns (std 0) at advantage 0 instead of 0/0.

  Returns:
    f32 [batch]. A group of one keeps its return (no baseline, no scale).
  """
  r = grouped(jnp.asarray(returns, jnp.float32), group_size)  # [groups, n]
  if group_size == 1:
    return r.reshape(-1)
  mean = jnp.mean(r, axis=1, keepdims=True)  # [groups, 1]
  centred = r - mean
  if norm_by_std:
    std = jnp.sqrt(jnp.sum(jnp.square(centred), axis=1, keepdims=True) / (group_size - 1))
    centred = centred / (std + eps)
  return centred.reshape(-1)


def leave_one_out(returns: jax.Array, group_size: int) -> jax.Array:
  """RLOO's sequence advantages R_i - mean of the group's other returns. f32 [batch]."""
  r = grouped(jnp.asarray(returns, jnp.float32), group_size)  # [groups, n]
  if group_size == 1:
    return r.reshape(-1)
  others = (jnp.sum(r, axis=1, keepdims=True) - r) / (group_size - 1)  # [groups, n]
  return (r - others).reshape(-1)


@ADVANTAGE_ESTIMATORS.register("grpo", needs_critic=False, normalises=True)
def grpo(rewards: jax.Array, values: None, mask: jax.Array, settings: AdvantageSettings
         ) -> tuple[jax.Array, jax.Array]:
  """Group-normalised sequence returns on every valid token (see the module docstring)."""
  del values  # critic-free
  returns = sequence_returns(rewards, mask)  # [batch]
  advantages = group_normalised(returns, settings.group_size,
                                norm_by_std=settings.norm_by_std, eps=settings.eps)
  return _per_token(advantages, mask), _per_token(returns, mask)


@ADVANTAGE_ESTIMATORS.register("rloo", needs_critic=False, normalises=True)
def rloo(rewards: jax.Array, values: None, mask: jax.Array, settings: AdvantageSettings
         ) -> tuple[jax.Array, jax.Array]:
  """Leave-one-out baselined sequence returns on every valid token."""
  del values  # critic-free
  returns = sequence_returns(rewards, mask)  # [batch]
  advantages = leave_one_out(returns, settings.group_size)
  return _per_token(advantages, mask), _per_token(returns, mask)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp", needs_critic=False, normalises=True)
def reinforce_pp(rewards: jax.Array, values: None, mask: jax.Array,
                 settings: AdvantageSettings) -> tuple[jax.Array, jax.Array]:
  """REINFORCE++: discounted return-to-go per token, whitened over the batch."""
  del values  # critic-free
  rewards = check_2d("rewards", rewards)
  # GAE with V = 0 and lambda = 1 is exactly the discounted return-to-go
  # (delta_t = r_t, A_t = r_t + gamma * A_{t+1}), episode ending at each row's last token.
  _, returns = gae(rewards, jnp.zeros_like(rewards), mask, settings.gamma, 1.0)
  return whiten(returns, mask), returns
