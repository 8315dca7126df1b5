"""PPO mathematics (GAE, whitening, KL, reward shaping, losses) against NumPy references.

The references are deliberately plain: Python loops per row and per token in float64,
sharing no code with the JAX implementations. Padded positions of every input hold large
garbage so that any leak from padding shows up as a mismatch.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from numpy.testing import assert_allclose
import pytest

from pipe_rlhf_jax.ppo import advantages as adv_lib
from pipe_rlhf_jax.ppo import kl as kl_lib
from pipe_rlhf_jax.ppo import losses as loss_lib
from pipe_rlhf_jax.ppo.registry import (
  ADVANTAGE_ESTIMATORS,
  KL_ESTIMATORS,
  POLICY_LOSSES,
)

RTOL = 1e-6
ATOL = 1e-6
LENGTHS = (7, 3, 0, 1, 5)  # Row 2 is all padding, row 3 a single token.
T = 7


def _mask(lengths=LENGTHS, length=T):
  return np.array([[t < n for t in range(length)] for n in lengths])


def _data(seed, mask, scale=1.0, garbage=1e4):
  """f32 random values on valid tokens, huge garbage on padding."""
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=mask.shape) * scale).astype(np.float32)
  return np.where(mask, x, np.float32(garbage)).astype(np.float32)


# ----------------------------------------------------------------------------- refs


def ref_gae(rewards, values, mask, gamma, lam):
  batch, length = rewards.shape
  adv = np.zeros((batch, length))
  ret = np.zeros((batch, length))
  for b in range(batch):
    next_adv = 0.0
    for t in reversed(range(length)):
      if not mask[b, t]:
        next_adv = 0.0
        continue
      next_valid = t + 1 < length and mask[b, t + 1]
      next_value = float(values[b, t + 1]) if next_valid else 0.0
      delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
      a = delta + (gamma * lam * next_adv if next_valid else 0.0)
      adv[b, t] = a
      ret[b, t] = a + float(values[b, t])
      next_adv = a
  return adv, ret


def ref_whiten(x, mask, shift_mean=True, eps=1e-8):
  vals = [float(x[b, t]) for b in range(x.shape[0]) for t in range(x.shape[1])
          if mask[b, t]]
  mean = sum(vals) / len(vals)
  var = sum((v - mean) ** 2 for v in vals) / len(vals)
  out = np.zeros(x.shape)
  for b in range(x.shape[0]):
    for t in range(x.shape[1]):
      if mask[b, t]:
        w = (float(x[b, t]) - mean) / math.sqrt(var + eps)
        out[b, t] = w if shift_mean else w + mean
  return out


def ref_kl(logp, ref, mask, estimator):
  out = np.zeros(logp.shape)
  for b in range(logp.shape[0]):
    for t in range(logp.shape[1]):
      if not mask[b, t]:
        continue
      lp, lr = float(logp[b, t]), float(ref[b, t])
      if estimator == "k1":
        out[b, t] = lp - lr
      elif estimator == "k2":
        out[b, t] = 0.5 * (lp - lr) ** 2
      else:
        out[b, t] = math.exp(lr - lp) - (lr - lp) - 1.0
  return out


def ref_shape_rewards(scores, kl, mask, coef):
  out = np.zeros(kl.shape)
  for b in range(kl.shape[0]):
    last = None
    for t in range(kl.shape[1]):
      if mask[b, t]:
        out[b, t] = -coef * float(kl[b, t])
        last = t
    if last is not None:
      out[b, last] += float(scores[b])
  return out


def ref_policy_loss(logp, old, adv, mask, eps, behaviour=None, cap=None):
  total, count, clipped_n, kl_sum, ratios, weights, capped_n = 0.0, 0, 0, 0.0, [], [], 0
  for b in range(logp.shape[0]):
    for t in range(logp.shape[1]):
      if not mask[b, t]:
        continue
      r = math.exp(float(logp[b, t]) - float(old[b, t]))
      a = float(adv[b, t])
      r_clip = min(max(r, 1.0 - eps), 1.0 + eps)
      loss = max(-a * r, -a * r_clip)
      clipped_n += int(-a * r_clip > -a * r)
      kl_sum += (r - 1.0) - math.log(r)
      ratios.append(r)
      if behaviour is not None:
        w = math.exp(float(old[b, t]) - float(behaviour[b, t]))
        weights.append(w)
        if cap is not None and w > cap:
          capped_n += 1
          w = cap
        loss *= w
      total += loss
      count += 1
  aux = {
      "clip_frac": clipped_n / count,
      "approx_kl": kl_sum / count,
      "ratio_mean": sum(ratios) / count,
      "ratio_max": max(ratios),
  }
  if behaviour is not None:
    aux.update(iw_mean=sum(weights) / count, iw_max=max(weights),
               iw_clip_frac=capped_n / count)
  return total / count, aux


def ref_value_loss(values, old, returns, mask, eps):
  total, count, clipped_n = 0.0, 0, 0
  for b in range(values.shape[0]):
    for t in range(values.shape[1]):
      if not mask[b, t]:
        continue
      v, o, r = float(values[b, t]), float(old[b, t]), float(returns[b, t])
      vc = o + min(max(v - o, -eps), eps)
      total += 0.5 * max((v - r) ** 2, (vc - r) ** 2)
      clipped_n += int((vc - r) ** 2 > (v - r) ** 2)
      count += 1
  return total / count, clipped_n / count


def ref_explained_variance(values, returns, mask):
  rs = [float(returns[b, t]) for b, t in zip(*np.nonzero(mask))]
  ds = [float(returns[b, t]) - float(values[b, t]) for b, t in zip(*np.nonzero(mask))]
  var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)
  return 1.0 - var(ds) / var(rs)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_reference(gamma, lam):
  mask = _mask()
  rewards = _data(0, mask)
  values = _data(1, mask)
  adv, ret = adv_lib.gae(rewards, values, mask, gamma, lam)
  ref_adv, ref_ret = ref_gae(rewards, values, mask, gamma, lam)
  assert adv.dtype == jnp.float32 and adv.shape == mask.shape
  assert_allclose(adv, ref_adv, rtol=RTOL, atol=ATOL)
  assert_allclose(ret, ref_ret, rtol=RTOL, atol=ATOL)
  assert np.all(np.asarray(adv)[~mask] == 0) and np.all(np.asarray(ret)[~mask] == 0)


def test_gae_undiscounted_returns_are_reward_to_go():
  # gamma = lam = 1: returns are the plain sum of future rewards within the row,
  # whatever the values are (an independent closed form).
  mask = _mask()
  rewards = _data(2, mask)
  values = _data(3, mask)
  _, ret = adv_lib.gae(rewards, values, mask, 1.0, 1.0)
  r = np.where(mask, rewards.astype(np.float64), 0.0)
  to_go = np.cumsum(r[:, ::-1], axis=1)[:, ::-1] * mask
  assert_allclose(ret, to_go, rtol=RTOL, atol=ATOL)


def test_gae_is_jittable_with_traced_discounts():
  mask = _mask()
  rewards, values = _data(4, mask), _data(5, mask)
  jitted = jax.jit(adv_lib.gae)
  adv, ret = jitted(rewards, values, jnp.asarray(mask), jnp.float32(0.9), jnp.float32(0.8))
  ref_adv, ref_ret = ref_gae(rewards, values, mask, np.float32(0.9), np.float32(0.8))
  assert_allclose(adv, ref_adv, rtol=RTOL, atol=ATOL)
  assert_allclose(ret, ref_ret, rtol=RTOL, atol=ATOL)
  # The registry entry is gae under the estimators' calling convention.
  settings = adv_lib.AdvantageSettings(gamma=0.9, lam=0.8)
  via_registry = ADVANTAGE_ESTIMATORS.get("gae")(rewards, values, jnp.asarray(mask), settings)
  assert_allclose(via_registry[0], ref_adv, rtol=RTOL, atol=ATOL)
  assert ADVANTAGE_ESTIMATORS.info("gae")["needs_critic"]


def test_gae_rejects_mismatched_mask():
  with pytest.raises(ValueError, match="mask"):
    adv_lib.gae(np.zeros((2, 4)), np.zeros((2, 4)), np.ones((2, 3), bool), 1.0, 1.0)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_reference(shift_mean):
  mask = _mask()
  x = _data(6, mask, scale=3.0)
  x = np.where(mask, x + 2.0, x).astype(np.float32)
  out = adv_lib.whiten(x, mask, shift_mean=shift_mean)
  assert_allclose(out, ref_whiten(x, mask, shift_mean), rtol=RTOL, atol=ATOL)
  assert np.all(np.asarray(out)[~mask] == 0)
  if shift_mean:
    valid = np.asarray(out)[mask]
    assert abs(valid.mean()) < 1e-6 and abs(valid.std() - 1.0) < 1e-5


def test_masked_mean_and_var():
  mask = _mask()
  x = _data(7, mask)
  vals = [float(x[b, t]) for b, t in zip(*np.nonzero(mask))]
  mean = sum(vals) / len(vals)
  assert_allclose(adv_lib.masked_mean(x, mask), mean, rtol=RTOL, atol=ATOL)
  assert_allclose(adv_lib.masked_var(x, mask),
                  sum((v - mean) ** 2 for v in vals) / len(vals), rtol=RTOL, atol=ATOL)
  rows = adv_lib.masked_mean(x, mask, axis=1)
  for b, n in enumerate(LENGTHS):
    expected = sum(float(x[b, t]) for t in range(n)) / n if n else 0.0
    assert_allclose(rows[b], expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_matches_reference(estimator):
  mask = _mask()
  logp = np.where(mask, -np.abs(_data(8, mask)), 0.0).astype(np.float32)
  ref = np.where(mask, -np.abs(_data(9, mask)), -200.0).astype(np.float32)
  out = jax.jit(kl_lib.kl_penalty, static_argnames="estimator")(
      logp, ref, mask, estimator=estimator)
  assert_allclose(out, ref_kl(logp, ref, mask, estimator), rtol=RTOL, atol=ATOL)
  assert np.all(np.asarray(out)[~mask] == 0)
  assert np.all(np.isfinite(np.asarray(out)))
  if estimator in ("k2", "k3"):
    assert np.all(np.asarray(out) >= 0)


def test_k3_is_nonnegative_even_for_tiny_differences():
  logp = np.linspace(-3.0, -1e-4, 64, dtype=np.float32)[None]
  ref = (logp + np.float32(1e-6) * np.sign(np.sin(np.arange(64)))).astype(np.float32)
  out = np.asarray(KL_ESTIMATORS.get("k3")(logp, ref))
  assert np.all(out >= 0)


def test_kl_estimators_are_unbiased_on_samples():
  # Tokens drawn from pi: mean of k1 and k3 converges to KL(pi || ref).
  rng = np.random.default_rng(10)
  p = rng.dirichlet(np.ones(6))
  q = rng.dirichlet(np.ones(6))
  true_kl = float(np.sum(p * np.log(p / q)))
  n = 200_000
  tokens = rng.choice(6, size=n, p=p)
  logp = np.log(p)[tokens].astype(np.float32)[None]
  logq = np.log(q)[tokens].astype(np.float32)[None]
  mask = np.ones_like(logp, bool)
  for name in ("k1", "k3"):
    est = np.asarray(kl_lib.kl_penalty(logp, logq, mask, name), np.float64)
    stderr = est.std() / math.sqrt(n)
    assert abs(est.mean() - true_kl) < 5 * stderr, name


def test_kl_unknown_estimator_names_the_field():
  with pytest.raises(ValueError, match="kl_estimator"):
    kl_lib.kl_penalty(np.zeros((1, 2)), np.zeros((1, 2)), np.ones((1, 2)), "k4")


def test_shape_rewards_matches_reference():
  mask = _mask()
  kl = _data(11, mask)
  scores = np.array([1.5, -2.0, 7.0, 0.25, 3.0], np.float32)
  out = jax.jit(kl_lib.shape_rewards)(scores, kl, mask, jnp.float32(0.1))
  expected = ref_shape_rewards(scores, kl, mask, np.float32(0.1))
  assert_allclose(out, expected, rtol=RTOL, atol=ATOL)
  assert np.all(np.asarray(out)[2] == 0)  # All-padding row gets no score.


def test_adaptive_kl_coef_moves_towards_target():
  assert kl_lib.adaptive_kl_coef(0.1, 8.0, 256, 6.0, 10_000) > 0.1
  assert kl_lib.adaptive_kl_coef(0.1, 4.0, 256, 6.0, 10_000) < 0.1
  assert kl_lib.adaptive_kl_coef(0.1, 6.0, 256, 6.0, 10_000) == pytest.approx(0.1)
  # The proportional error saturates at +-0.2.
  assert kl_lib.adaptive_kl_coef(0.1, 600.0, 100, 6.0, 1000) == pytest.approx(0.1 * 1.02)
  assert kl_lib.adaptive_kl_coef(0.1, 0.0, 100, 6.0, 1000) == pytest.approx(0.1 * 0.98)
  jitted = jax.jit(kl_lib.adaptive_kl_coef)(
      jnp.float32(0.1), jnp.float32(7.0), jnp.float32(256), jnp.float32(6.0),
      jnp.float32(10_000))
  assert_allclose(jitted, kl_lib.adaptive_kl_coef(0.1, 7.0, 256, 6.0, 10_000), rtol=RTOL)
  with pytest.raises(ValueError, match="target"):
    kl_lib.adaptive_kl_coef(0.1, 1.0, 1, 0.0, 10)


def _policy_inputs(seed):
  mask = _mask()
  rng = np.random.default_rng(seed)
  old = np.where(mask, -rng.uniform(0.1, 3.0, mask.shape), 50.0).astype(np.float32)
  # Ratios spread over roughly [0.6, 1.6] so both clip edges are exercised.
  logp = np.where(mask, old + rng.uniform(-0.5, 0.5, mask.shape), -50.0).astype(np.float32)
  adv = _data(seed + 1, mask)
  behaviour = np.where(mask, old + rng.uniform(-0.7, 0.7, mask.shape), 80.0).astype(
      np.float32)
  return logp, old, adv, mask, behaviour


def _check_aux(aux, ref_aux):
  assert set(aux) == set(ref_aux)
  for key, value in ref_aux.items():
    assert_allclose(aux[key], value, rtol=RTOL, atol=ATOL, err_msg=key)


def test_policy_loss_matches_reference():
  logp, old, adv, mask, _ = _policy_inputs(20)
  loss, aux = jax.jit(loss_lib.policy_loss, static_argnames="clip_eps")(
      logp, old, adv, mask, clip_eps=0.2)
  ref_loss, ref_aux = ref_policy_loss(logp, old, adv, mask, 0.2)
  assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
  _check_aux(aux, ref_aux)
  assert 0 < ref_aux["clip_frac"] < 1  # The example exercises both branches.


@pytest.mark.parametrize("cap", [None, 1.3])
def test_decoupled_policy_loss_matches_reference(cap):
  logp, old, adv, mask, behaviour = _policy_inputs(30)
  fn = POLICY_LOSSES.get("decoupled_ppo_clip")
  loss, aux = jax.jit(lambda *a: fn(*a[:4], clip_eps=0.2, behaviour_logprobs=a[4],
                                    behaviour_weight_cap=cap))(
      logp, old, adv, mask, behaviour)
  ref_loss, ref_aux = ref_policy_loss(logp, old, adv, mask, 0.2, behaviour, cap)
  assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
  _check_aux(aux, ref_aux)
  if cap is not None:
    assert 0 < ref_aux["iw_clip_frac"] < 1


def test_policy_registry_entries():
  logp, old, adv, mask, behaviour = _policy_inputs(40)
  plain, _ = loss_lib.policy_loss(logp, old, adv, mask, clip_eps=0.2)
  via_registry, aux = POLICY_LOSSES.get("ppo_clip")(
      logp, old, adv, mask, clip_eps=0.2, behaviour_logprobs=behaviour)
  assert_allclose(via_registry, plain, rtol=0, atol=0)
  assert "iw_mean" not in aux
  with pytest.raises(ValueError, match="behaviour_logprobs"):
    POLICY_LOSSES.get("decoupled_ppo_clip")(logp, old, adv, mask, clip_eps=0.2)
  with pytest.raises(ValueError, match="mask"):
    loss_lib.policy_loss(logp, old, adv, mask[:, :3], clip_eps=0.2)


def test_policy_loss_gradients():
  logp, old, adv, mask, behaviour = _policy_inputs(50)
  eps = 0.2
  n_valid = mask.sum()
  ratio = np.exp(logp.astype(np.float64) - old)
  # The clipped branch is active (zero gradient) where the advantage pushes the ratio
  # further past the edge it already crossed.
  clipped = ((adv > 0) & (ratio > 1 + eps)) | ((adv < 0) & (ratio < 1 - eps))
  assert clipped[mask].any() and (~clipped[mask]).any()

  grad = np.asarray(jax.grad(
      lambda lp: loss_lib.policy_loss(lp, old, adv, mask, clip_eps=eps)[0])(logp))
  assert np.all(grad[~mask] == 0)
  assert np.all(grad[mask & clipped] == 0)
  expected = np.where(mask & ~clipped, -adv * ratio / n_valid, 0.0)
  assert_allclose(grad, expected, rtol=RTOL, atol=ATOL)

  # Decoupled: the same gradient scaled by the (capped) constant weight; no gradient
  # reaches the proximal or behaviour log-probs.
  cap = 1.3
  def decoupled(lp, o, bh):
    return loss_lib.policy_loss(lp, o, adv, mask, clip_eps=eps, behaviour_logprobs=bh,
                                behaviour_weight_cap=cap)[0]
  g_lp, g_old, g_bh = jax.grad(decoupled, argnums=(0, 1, 2))(logp, old, behaviour)
  weight = np.minimum(np.exp(old.astype(np.float64) - behaviour), cap)
  assert_allclose(g_lp, np.where(mask, expected * weight, 0.0), rtol=RTOL, atol=ATOL)
  assert np.all(np.asarray(g_old) == 0) and np.all(np.asarray(g_bh) == 0)
  assert np.all(np.isfinite(np.asarray(g_lp)))


def test_value_loss_matches_reference_and_gradients():
  mask = _mask()
  rng = np.random.default_rng(60)
  old = _data(61, mask)
  values = np.where(mask, old + rng.uniform(-0.6, 0.6, mask.shape), -1e4).astype(
      np.float32)
  returns = _data(62, mask)
  eps = 0.2
  loss, aux = jax.jit(loss_lib.value_loss, static_argnames="clip_eps")(
      values, old, returns, mask, clip_eps=eps)
  ref_loss, ref_clip = ref_value_loss(values, old, returns, mask, eps)
  assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
  assert_allclose(aux["value_clip_frac"], ref_clip, rtol=RTOL, atol=ATOL)
  assert 0 < ref_clip < 1
  assert_allclose(aux["explained_variance"],
                  ref_explained_variance(values, returns, mask), rtol=RTOL, atol=ATOL)

  grad = np.asarray(jax.grad(
      lambda v: loss_lib.value_loss(v, old, returns, mask, clip_eps=eps)[0])(values))
  v, o, r = values.astype(np.float64), old.astype(np.float64), returns.astype(np.float64)
  vc = o + np.clip(v - o, -eps, eps)
  # Where the clipped term wins and clipping is active, the loss is flat in v.
  flat = ((vc - r) ** 2 > (v - r) ** 2) & (np.abs(v - o) > eps)
  expected = np.where(mask & ~flat, (v - r) / mask.sum(), 0.0)
  assert_allclose(grad, expected, rtol=RTOL, atol=ATOL)


def test_explained_variance_edges():
  mask = _mask()
  returns = _data(70, mask)
  assert_allclose(loss_lib.explained_variance(returns, returns, mask), 1.0, atol=ATOL)
  const = np.where(mask, 2.0, 0.0).astype(np.float32)
  assert float(loss_lib.explained_variance(returns, const, mask)) == 0.0


def test_entropy_from_logits():
  rng = np.random.default_rng(80)
  logits = rng.normal(size=(2, 3, 5)).astype(np.float32) * 2
  logits[1, 2, 1:3] = -np.inf  # Vocabulary excluded by top-k style masking.
  # Low-precision logits are upcast: the output is float32.
  ent = jax.jit(loss_lib.entropy_from_logits)(jnp.asarray(logits, jnp.bfloat16))
  ent_f32 = loss_lib.entropy_from_logits(logits)

  ref_ent = np.zeros((2, 3))
  for b in range(2):
    for t in range(3):
      row = [float(z) for z in logits[b, t]]
      top = max(row)
      log_z = top + math.log(sum(math.exp(z - top) for z in row))
      ref_ent[b, t] = -sum(math.exp(z - log_z) * (z - log_z) for z in row
                           if z != -math.inf)
  assert ent.shape == (2, 3) and ent.dtype == jnp.float32
  assert ent_f32.dtype == jnp.float32
  assert_allclose(ent_f32, ref_ent, rtol=RTOL, atol=ATOL)
  # bf16 keeps ~3 significant digits of each logit.
  assert_allclose(ent, ref_ent, rtol=0, atol=0.05)
  # Log-probs are logits of the same distribution: the entropy does not change.
  logp = jax.nn.log_softmax(logits, axis=-1)
  assert_allclose(loss_lib.entropy_from_logits(logp), ref_ent, rtol=RTOL, atol=ATOL)


def test_entropy_from_logprobs_equals_it_without_a_second_log_softmax():
  rng = np.random.default_rng(81)
  logits = rng.normal(size=(2, 3, 5)).astype(np.float32) * 2
  logits[1, 2, 1:3] = -np.inf
  logp = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
  assert_allclose(loss_lib.entropy_from_logprobs(logp), loss_lib.entropy_from_logits(logits),
                  rtol=RTOL, atol=ATOL)
  # Excluded entries keep the entropy's gradient finite (it is a loss term with
  # ppo.entropy_coef > 0), and it matches the gradient through the logits.
  grad = lambda f: jax.grad(lambda z: jnp.sum(f(z)))(jnp.asarray(logits))
  via_logp = grad(lambda z: loss_lib.entropy_from_logprobs(jax.nn.log_softmax(z, axis=-1)))
  assert np.all(np.isfinite(via_logp))
  assert_allclose(via_logp, grad(loss_lib.entropy_from_logits), rtol=RTOL, atol=ATOL)
