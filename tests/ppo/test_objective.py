"""The PPO objective (`ppo/objective.py`) on small hand-built arrays: each term's value and
gradient as the formulas say, padding excluded, the early-stop threshold."""

import types

import jax
import jax.numpy as jnp
import numpy as np

from pipe_rlhf_jax.ppo import objective


def settings(**overrides):
  base = dict(loss="ppo_clip", clip_eps=0.2, behaviour_weight_cap=None,
              loss_agg="token_mean", loss_norm_len=0, entropy_coef=0.0, target_kl=0.0,
              ptx_coef=0.0, kl_loss_coef=0.0, kl_estimator="k3", value_clip_eps=0.2)
  return types.SimpleNamespace(**{**base, **overrides})


MASK = jnp.array([[True, True, False]])  # the third position is padding


def test_clipped_surrogate_takes_the_pessimistic_term():
  # Ratios e^0.5 (above 1 + eps) and e^-0.5 (below 1 - eps), advantage +1 on both.
  logprobs = jnp.array([[0.5, -0.5, 9.0]])
  old = jnp.zeros((1, 3))
  adv = jnp.ones((1, 3))
  loss, aux = objective.actor_objective(logprobs, jnp.zeros((1, 3)), old, adv, MASK,
                                        settings())
  # -min(r A, clip(r) A): the first clipped to 1.2, the second keeps e^-0.5.
  expected = -(1.2 + np.exp(-0.5)) / 2
  np.testing.assert_allclose(float(loss), expected, rtol=1e-6)
  np.testing.assert_allclose(float(aux["policy_loss"]), expected, rtol=1e-6)


def test_zero_advantage_gives_zero_policy_gradient():
  grad = jax.grad(lambda lp: objective.actor_objective(
      lp, jnp.zeros((1, 3)), jnp.zeros((1, 3)), jnp.zeros((1, 3)), MASK, settings())[0])(
          jnp.array([[0.1, -0.1, 0.0]]))
  np.testing.assert_array_equal(np.asarray(grad), 0.0)


def test_entropy_bonus_ptx_and_kl_terms_add_their_coefficients():
  logprobs = jnp.array([[-1.0, -2.0, 0.0]])
  ref = jnp.array([[-1.5, -1.0, 0.0]])
  entropy = jnp.array([[0.5, 1.5, 100.0]])  # the padding's entropy must not count
  args = (logprobs, entropy, logprobs, jnp.zeros((1, 3)), MASK)
  base, _ = objective.actor_objective(*args, settings())
  loss, aux = objective.actor_objective(
      *args, settings(entropy_coef=0.1, ptx_coef=0.5, kl_loss_coef=0.2),
      ref_logprobs=ref, ptx_nll=jnp.float32(2.0))
  # k3 = exp(ref - lp) - (ref - lp) - 1 per valid token, token mean.
  d = np.array([-0.5, 1.0])
  k3 = float(np.mean(np.exp(d) - d - 1))
  np.testing.assert_allclose(float(aux["kl_loss"]), k3, rtol=1e-6)
  np.testing.assert_allclose(float(aux["entropy"]), 1.0, rtol=1e-6)
  np.testing.assert_allclose(float(aux["ptx_loss"]), 2.0)
  np.testing.assert_allclose(float(loss), float(base) - 0.1 * 1.0 + 0.5 * 2.0 + 0.2 * k3,
                             rtol=1e-6)


def test_padding_changes_nothing():
  rng = np.random.default_rng(0)
  lp, old, adv = (jnp.asarray(rng.normal(size=(1, 3)), jnp.float32) for _ in range(3))
  moved = lp.at[0, 2].set(50.0)
  a, _ = objective.actor_objective(lp, jnp.zeros((1, 3)), old, adv, MASK, settings())
  b, _ = objective.actor_objective(moved, jnp.zeros((1, 3)), old, adv, MASK, settings())
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_critic_objective_is_the_clipped_value_loss():
  values = jnp.array([[1.0, 0.0, 7.0]])
  old = jnp.zeros((1, 3))
  returns = jnp.array([[0.0, 1.0, 0.0]])
  loss, aux = objective.critic_objective(values, old, returns, MASK, settings())
  # Token 0: max((1-0)^2, (0.2-0)^2) = 1; token 1: max(1, 1) = 1; half of their mean.
  np.testing.assert_allclose(float(loss), 0.5 * (1.0 + 1.0) / 2, rtol=1e-6)
  assert float(aux["value_loss"]) == float(loss)


def test_early_stop_past_the_factor_times_the_target():
  target = 0.01
  assert not bool(objective.early_stop(jnp.float32(0.014), target))
  assert bool(objective.early_stop(jnp.float32(0.016), target))
  lp = jnp.array([[0.1, -0.1, 3.0]])
  kl = float(objective.kl_from_start(lp, jnp.zeros((1, 3)), MASK))
  r = np.array([0.1, -0.1])
  np.testing.assert_allclose(kl, np.mean(np.expm1(r) - r), rtol=1e-6)


def test_decoupled_loss_of_a_mixed_version_completion_is_its_per_token_definition():
  # Partial rollouts: a completion's first tokens drawn by version 0, the rest by
  # version 1, each with its own behaviour log-prob. The decoupled loss over the mixed
  # row equals the token-weighted combination of the loss over each version's tokens
  # alone: a token's importance weight reads its own behaviour log-prob only.
  from pipe_rlhf_jax.ppo.losses import POLICY_LOSSES
  rs = np.random.RandomState(0)
  shape = (3, 8)
  logprobs, prox, adv = (jnp.asarray(rs.normal(-2, 0.3, shape), jnp.float32)
                         for _ in range(3))
  behaviour = {v: jnp.asarray(rs.normal(-2, 0.3, shape), jnp.float32) for v in (0, 1)}
  version = np.broadcast_to(np.arange(8) >= 3, shape).astype(np.int32)  # [3, 8]
  mask = np.ones(shape, bool)
  mask[2, 6:] = False
  mixed = jnp.where(version == 1, behaviour[1], behaviour[0])
  loss_fn = POLICY_LOSSES.get("decoupled_ppo_clip")
  kwargs = dict(clip_eps=0.2, behaviour_weight_cap=2.0, loss_agg="token_mean")
  whole, _ = loss_fn(logprobs, prox, adv, mask, behaviour_logprobs=mixed, **kwargs)
  parts = []
  for v in (0, 1):
    part_mask = mask & (version == v)
    loss, _ = loss_fn(logprobs, prox, adv, part_mask, behaviour_logprobs=behaviour[v],
                      **kwargs)
    parts.append(float(loss) * part_mask.sum())
  np.testing.assert_allclose(float(whole), sum(parts) / mask.sum(), rtol=1e-6)
