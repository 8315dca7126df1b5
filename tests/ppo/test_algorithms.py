"""Critic-free advantage estimators, loss aggregation and their settings, by hand.

Every expected value is written out from the published definitions (see
`ppo/critic_free.py` and `ppo/aggregation.py`) with small numbers; padded positions hold
garbage (huge or non-finite) so that a leak from padding shows up.
"""

import math

import jax.numpy as jnp
import numpy as np
from numpy.testing import assert_allclose
import pytest

from pipe_rlhf_jax.config import PPOSettings
from pipe_rlhf_jax.ppo.advantages import AdvantageSettings
from pipe_rlhf_jax.ppo.aggregation import aggregate
from pipe_rlhf_jax.ppo.losses import policy_loss
from pipe_rlhf_jax.ppo.registry import ADVANTAGE_ESTIMATORS
from pipe_rlhf_jax.stages.generate import repeat_for_groups

GARBAGE = 1e6


def rollout_rewards(seq_returns, lengths, length=4, seed=0, spread=0.1):
  """Per-token rewards whose valid tokens sum to `seq_returns` (a KL-shaped-like spread:
  random per-token terms of scale `spread`, the remainder on the last token), garbage on
  padding."""
  rs = np.random.RandomState(seed)
  mask = np.arange(length)[None, :] < np.asarray(lengths)[:, None]
  rewards = np.where(mask, rs.normal(scale=spread, size=mask.shape), GARBAGE)
  for row, (ret, n) in enumerate(zip(seq_returns, lengths)):
    if n:
      rewards[row, n - 1] += ret - rewards[row, :n].sum()
  return jnp.asarray(rewards, jnp.float32), jnp.asarray(mask)


def estimate(name, rewards, mask, **settings):
  return ADVANTAGE_ESTIMATORS.get(name)(rewards, None, mask, AdvantageSettings(**settings))


def on_tokens(per_seq, mask):
  return np.where(np.asarray(mask), np.asarray(per_seq, np.float64)[:, None], 0.0)


# Two groups of three completions of different lengths (row 4 is a single token).
RETURNS = [1.0, 2.0, 4.0, 0.5, -1.0, 3.0]
LENGTHS = [4, 2, 3, 1, 4, 3]


def test_grpo_normalises_each_group_by_its_mean_and_sample_std():
  rewards, mask = rollout_rewards(RETURNS, LENGTHS)
  adv, ret = estimate("grpo", rewards, mask, group_size=3, eps=1e-6)
  want = []
  for group in (RETURNS[:3], RETURNS[3:]):
    mean = sum(group) / 3
    std = math.sqrt(sum((r - mean) ** 2 for r in group) / 2)  # Bessel's correction
    want += [(r - mean) / (std + 1e-6) for r in group]
  # e.g. the first group: mean 7/3, std sqrt(7/3) -> (1 - 7/3) / sqrt(7/3) = -0.8729
  assert_allclose(want[0], -0.87287156, rtol=1e-6)
  assert_allclose(adv, on_tokens(want, mask), rtol=1e-5, atol=1e-6)
  assert_allclose(ret, on_tokens(RETURNS, mask), rtol=1e-5, atol=1e-5)


def test_grpo_without_std_only_subtracts_the_group_mean():
  rewards, mask = rollout_rewards(RETURNS, LENGTHS)
  adv, _ = estimate("grpo", rewards, mask, group_size=3, norm_by_std=False)
  want = [1 - 7 / 3, 2 - 7 / 3, 4 - 7 / 3, 0.5 - 2.5 / 3, -1 - 2.5 / 3, 3 - 2.5 / 3]
  assert_allclose(adv, on_tokens(want, mask), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "rloo"])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_a_group_of_equal_returns_has_zero_advantage(name, norm_by_std):
  # The score alone on the last token (a rule reward, KL in the loss): the sums are
  # exactly equal. (Spread over tokens in float32 they would differ by rounding, ~1e-7,
  # which GRPO divides by std + eps ~ 1e-6: advantages of order 0.1, not 0.)
  rewards, mask = rollout_rewards([0.7] * 4 + [1.0, 0.0, 0.0, 0.0], [4, 1, 3, 2] * 2,
                                  spread=0.0)
  adv, _ = estimate(name, rewards, mask, group_size=4, norm_by_std=norm_by_std)
  adv = np.asarray(adv)
  assert np.all(np.abs(adv[:4]) < 1e-5)  # std 0: eps keeps 0 / 0 away
  assert np.abs(adv[4:]).max() > 0.5  # the other group is not zero


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_a_group_of_one_keeps_its_return(name):
  # No other sample, no baseline (verl's convention); PPOSettings refuses group_size=1.
  rewards, mask = rollout_rewards(RETURNS, LENGTHS)
  adv, _ = estimate(name, rewards, mask, group_size=1)
  assert_allclose(adv, on_tokens(RETURNS, mask), rtol=1e-5, atol=1e-5)


def test_rloo_baseline_is_the_mean_of_the_other_samples():
  rewards, mask = rollout_rewards(RETURNS, LENGTHS)
  adv, _ = estimate("rloo", rewards, mask, group_size=3)
  # 1 - (2 + 4) / 2, 2 - (1 + 4) / 2, 4 - (1 + 2) / 2; 0.5 - (-1 + 3) / 2, ...
  want = [-2.0, -0.5, 2.5, -0.5, -2.75, 3.25]
  assert_allclose(adv, on_tokens(want, mask), rtol=1e-5, atol=1e-5)


def test_reinforce_pp_whitens_discounted_returns_to_go_over_the_batch():
  rewards = np.array([[0.1, -0.2, 1.0], [0.3, 2.0, GARBAGE], [GARBAGE] * 3], np.float32)
  mask = np.array([[1, 1, 1], [1, 1, 0], [0, 0, 0]], bool)
  gamma = 0.5
  adv, ret = estimate("reinforce_pp", jnp.asarray(rewards), jnp.asarray(mask), gamma=gamma)
  # G_t = r_t + gamma * G_{t+1} within each row, the episode ending at its last token.
  g = [[0.1 + 0.5 * (-0.2 + 0.5 * 1.0), -0.2 + 0.5 * 1.0, 1.0], [0.3 + 0.5 * 2.0, 2.0]]
  assert_allclose(np.asarray(ret)[0], g[0], rtol=1e-6)
  assert_allclose(np.asarray(ret)[1, :2], g[1], rtol=1e-6)
  valid = g[0] + g[1]
  mean = sum(valid) / 5
  std = math.sqrt(sum((x - mean) ** 2 for x in valid) / 5)
  want = np.zeros((3, 3))
  want[0] = [(x - mean) / std for x in g[0]]
  want[1, :2] = [(x - mean) / std for x in g[1]]
  assert_allclose(adv, want, rtol=1e-5, atol=1e-6)


def test_critic_free_estimators_are_registered_as_such():
  for name in ("grpo", "rloo", "reinforce_pp"):
    assert ADVANTAGE_ESTIMATORS.info(name) == {"needs_critic": False, "normalises": True}
  assert ADVANTAGE_ESTIMATORS.info("gae")["needs_critic"]


def test_a_batch_of_partial_groups_is_refused():
  rewards, mask = rollout_rewards(RETURNS[:5], LENGTHS[:5])
  with pytest.raises(ValueError, match="ppo.group_size=3"):
    estimate("grpo", rewards, mask, group_size=3)


def test_group_sampling_repeats_prompts_with_distinct_sample_ids():
  batch = {"prompt_tokens": np.array([[0, 5], [6, 7]]),
           "prompt_mask": np.array([[0, 1], [1, 1]], bool),
           "index": np.array([10, 11])}
  out = repeat_for_groups(batch, 3)
  assert out["prompt_tokens"].tolist() == [[0, 5]] * 3 + [[6, 7]] * 3
  assert out["index"].tolist() == [30, 31, 32, 33, 34, 35]
  assert repeat_for_groups(batch, 1) is batch


# ------------------------------------------------------------------ loss aggregation

PER_TOKEN = np.array([[1.0, 2.0, 3.0, 4.0],
                      [5.0, np.inf, np.nan, GARBAGE],  # one valid token
                      [np.nan] * 4,  # all padding
                      [2.0, 4.0, GARBAGE, GARBAGE]], np.float32)
MASK = np.array([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]], bool)


@pytest.mark.parametrize("how, norm_len, want", [
    ("token_mean", 0, (1 + 2 + 3 + 4 + 5 + 2 + 4) / 7),
    ("seq_mean_token_mean", 0, (2.5 + 5.0 + 3.0) / 3),  # the empty row does not count
    ("token_sum_norm", 0, 21 / (4 * 4)),  # 4 rows x the completion length 4
    ("token_sum_norm", 10, 21 / (4 * 10)),
])
def test_loss_aggregations_by_hand(how, norm_len, want):
  got = aggregate(jnp.asarray(PER_TOKEN), jnp.asarray(MASK), how, norm_len)
  assert_allclose(float(got), want, rtol=1e-6)


def test_policy_loss_is_aggregated_as_asked():
  # At ratio 1 the clipped surrogate is -A per token.
  adv = np.array([[1.0, -1.0, 3.0], [2.0, GARBAGE, GARBAGE]], np.float32)
  mask = np.array([[1, 1, 1], [1, 0, 0]], bool)
  lp = jnp.asarray(np.where(mask, -1.0, 0.0), jnp.float32)
  for how, want in (("token_mean", -(1 - 1 + 3 + 2) / 4),
                    ("seq_mean_token_mean", -(3 / 3 + 2) / 2),
                    ("token_sum_norm", -5 / (2 * 3))):
    loss, _ = policy_loss(lp, lp, jnp.asarray(adv), jnp.asarray(mask), clip_eps=0.2,
                          loss_agg=how)
    assert_allclose(float(loss), want, rtol=1e-6, err_msg=how)


# ------------------------------------------------------------------------- settings


def ppo(**fields):
  base = dict(steps=1, batch_size=8, minibatch_size=4)
  return PPOSettings(**{**base, **fields})


@pytest.mark.parametrize("fields, message", [
    (dict(group_size=3), r"ppo.batch_size=8 must be a multiple of ppo.group_size=3"),
    (dict(group_size=8), r"ppo.minibatch_size=4 must be a multiple of ppo.group_size=8"),
    (dict(advantage_estimator="grpo", group_size=4),
     r"ppo.whiten_advantages=True with ppo.advantage_estimator='grpo'.*=False"),
    (dict(advantage_estimator="rloo", whiten_advantages=False),
     r"'rloo' needs ppo.group_size >= 2.*'reinforce_pp'"),
    (dict(kl_in="both"), r"ppo.kl_in='both'; choose one of \['loss', 'reward'\]"),
    (dict(loss_agg="sum"), r"ppo.loss_agg='sum'; choose one of .*token_sum_norm"),
    (dict(loss_norm_len=-1), r"ppo.loss_norm_len"),
    (dict(kl_in="loss", adaptive_kl=True), r"ppo.adaptive_kl=True .* ppo.kl_in='reward'"),
    (dict(kl_coef=0.0, adaptive_kl=True), r"ppo.adaptive_kl=True with ppo.kl_coef=0"),
    (dict(grpo_norm_by_std="yes"), r"ppo.grpo_norm_by_std='yes' must be True or False"),
    (dict(kl_policy="current"), r"ppo.kl_policy='current'; choose one of .*'proximal'"),
    (dict(target_kl=-0.1), r"ppo.target_kl"),
    (dict(ptx_coef=float("nan")), r"ppo.ptx_coef=nan must be a number >= 0"),
    (dict(kl_coef=float("inf")), r"ppo.kl_coef=inf must be a number >= 0"),
    (dict(ptx_batch_size=2.5), r"ppo.ptx_batch_size=2.5 must be an integer >= 0"),
])
def test_settings_refuse_bad_algorithm_fields(fields, message):
  with pytest.raises(ValueError, match=message):
    ppo(**fields)


def test_ptx_rows_default_to_the_minibatch_and_are_zero_without_the_term():
  assert ppo().ptx_rows == 0 and ppo(ptx_batch_size=16).ptx_rows == 0
  assert ppo(ptx_coef=0.5).ptx_rows == 4
  assert ppo(ptx_coef=0.5, ptx_batch_size=16).ptx_rows == 16


def test_proximal_kl_policy_acts_only_where_the_rewards_hold_a_kl():
  from pipe_rlhf_jax.stages.train import TrainSettings
  settings = TrainSettings.from_settings(ppo(kl_policy="proximal"), 1.0)
  assert settings.kl_policy == "proximal" and settings.targets.kl_in == "reward"
  # KL in the loss, or none: the re-derived targets would equal the inference stage's.
  for fields in (dict(kl_in="loss", kl_estimator="k3"), dict(kl_coef=0.0)):
    settings = TrainSettings.from_settings(ppo(kl_policy="proximal", **fields), 1.0)
    assert settings.kl_policy == "behaviour" and settings.targets is None


def test_settings_say_which_models_the_algorithm_needs():
  grpo = ppo(advantage_estimator="grpo", group_size=4, whiten_advantages=False,
             kl_coef=0.0)
  assert not grpo.needs_critic and not grpo.needs_reference
  assert grpo.prompts_per_step == 2
  assert ppo().needs_critic and ppo().needs_reference and ppo().prompts_per_step == 8


def test_experiment_config_validation_names_the_new_fields():
  from pipe_rlhf_jax.config import ExperimentSettings
  from tests.helpers.configs import tiny_quickstart
  config = tiny_quickstart(overrides={"ppo.group_size": 3})
  with pytest.raises(ValueError, match=r"ppo.batch_size=16 must be a multiple of "
                                       r"ppo.group_size=3"):
    ExperimentSettings.from_config(config)
