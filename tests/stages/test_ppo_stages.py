"""The PPO stages composed on a tiny model: generate -> infer -> train on one device.

Covers the mathematics the stages add on top of `ppo/` (tested alone in
tests/ppo/test_math.py): which distribution every log-prob is taken under, the first-step
ratio, the decoupled importance weight, and KL shaping + GAE + whitening as the
inference stage composes them, each against a hand / numpy computation.
"""

import types

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pipe_rlhf_jax.concurrency.tracing import Tracer
from pipe_rlhf_jax.generation.sampler import SamplingSettings
from pipe_rlhf_jax.models.config import tiny_config
from pipe_rlhf_jax.models.transformer import init_model
from pipe_rlhf_jax.optim import make_optimizer
from pipe_rlhf_jax.parallel import logical
from pipe_rlhf_jax.parallel.mesh import make_mesh
from pipe_rlhf_jax.phases import supervised
from pipe_rlhf_jax.ppo.types import Experience, Rollout
from pipe_rlhf_jax.stages.common import StageLayout
from pipe_rlhf_jax.stages.generate import GenerateStage
from pipe_rlhf_jax.stages.infer import InferSettings, InferStage
from pipe_rlhf_jax.stages.train import PtxBatch, TrainSettings, TrainStage
from tests.helpers.configs import tiny_quickstart

VOCAB = 64
BATCH, PROMPT, COMPLETION = 8, 5, 8


def ppo_section(**overrides):
  """The `config.ppo` fields the stage hypers read, quickstart defaults otherwise."""
  ppo = dict(kl_estimator="k1", advantage_estimator="gae", gamma=1.0, lam=0.95,
             whiten_advantages=True, temperature=1.0, top_k=0, top_p=1.0, epochs=1,
             minibatch_size=BATCH, clip_eps=0.2, value_clip_eps=0.2, entropy_coef=0.0,
             loss="ppo_clip", behaviour_weight_cap=2.0, kl_in="reward", kl_coef=0.1,
             group_size=1, grpo_norm_by_std=True, grpo_eps=1e-6, loss_agg="token_mean",
             loss_norm_len=0, reward_shift=0.0, reward_scale=1.0, kl_policy="behaviour",
             target_kl=0.0, ptx_coef=0.0, ptx_rows=0)
  ppo.update(overrides)
  return types.SimpleNamespace(**ppo)


@pytest.fixture(scope="module")
def layout():
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  return StageLayout("all", mesh, logical.DEFAULT_RULES)


@pytest.fixture(scope="module")
def models():
  """(graphdef, state) of a tiny actor, critic and reward model."""
  config = tiny_config(vocab_size=VOCAB, embed_dim=32, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp_dim=64)
  out = {}
  for seed, (name, head) in enumerate((("actor", "lm"), ("critic", "value"),
                                       ("reward", "score"))):
    out[name] = nnx.split(init_model(config.replace(head=head), seed=seed))
  return out


def prompts(seed=0):
  """A host prompt batch, left-padded with varied lengths."""
  rs = np.random.RandomState(seed)
  tokens = np.zeros((BATCH, PROMPT), np.int32)
  mask = np.zeros((BATCH, PROMPT), bool)
  for row in range(BATCH):
    n = 1 + row % PROMPT
    tokens[row, PROMPT - n:] = rs.randint(1, VOCAB, n)
    mask[row, PROMPT - n:] = True
  return {"prompt_tokens": tokens, "prompt_mask": mask,
          "index": np.arange(BATCH, dtype=np.int32)}


def moved(state, seed, scale=0.5):
  """A copy of `state` with every parameter perturbed: a policy that has trained."""
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [
      x + scale * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
      for x, k in zip(leaves, keys)])


def train_stage(layout, models, ppo):
  tx = lambda: make_optimizer(1e-3, total_steps=10)
  return TrainStage(layout, models["actor"][0], models["critic"][0],
                    TrainSettings.from_settings(ppo, ppo.temperature), tx(), tx())


@pytest.mark.slow
def test_truncated_sampling_keeps_every_quantity_finite_and_on_policy(layout, models):
  # With top-k / top-p, log-probs under each model's truncated distribution would give a
  # token outside the REFERENCE's nucleus a log-prob of -1e30, so a KL of ~1e30 that
  # whitening spreads over every other advantage. All log-probs are under the tempered,
  # untruncated policy.
  ppo = ppo_section(top_k=5, top_p=0.9, temperature=0.8)
  actor_gd, ref = models["actor"]
  actor = moved(ref, seed=1)  # the policy has moved away from the reference
  sampling = SamplingSettings(max_new_tokens=COMPLETION, temperature=ppo.temperature,
                            top_k=ppo.top_k, top_p=ppo.top_p, eos_id=None)
  rollout, _ = GenerateStage(layout, actor_gd, sampling)(
      actor, prompts(), jax.random.key(0), version=1)
  infer = InferStage(layout, actor_gd, models["critic"][0], models["reward"][0],
                     InferSettings.from_settings(ppo, ppo.temperature))
  exp, metrics = infer(ref, models["critic"][1], models["reward"][1], rollout, 0.1)
  mask = np.asarray(rollout.completion_mask)
  ref_lp = np.asarray(exp.ref_logprobs)[mask]
  assert ref_lp.min() > -100.0, f"reference log-prob {ref_lp.min()} of a sampled token"
  assert np.isfinite(metrics["kl/mean"]) and abs(float(metrics["kl/mean"])) < 100.0
  assert np.abs(np.asarray(exp.advantages)[mask]).max() < 10.0

  trainer = train_stage(layout, models, ppo)
  state = trainer.init_state(actor, models["critic"][1])
  _, train_metrics = trainer.update(state, exp, jax.random.key(2))
  # One epoch, one minibatch: the ratio is taken on the weights that sampled.
  assert abs(float(train_metrics["ratio_mean"]) - 1.0) < 1e-6
  assert abs(float(train_metrics["ratio_max"]) - 1.0) < 1e-6
  assert float(train_metrics["clip_frac"]) == 0.0
  assert float(train_metrics["bad_updates"]) == 0.0


def hand_rollout(seed=0):
  """A Rollout with varied completion lengths (one row all padding) and random tokens."""
  rs = np.random.RandomState(seed)
  batch = prompts(seed)
  lengths = np.array([COMPLETION, 1, 5, 0, 3, COMPLETION, 7, 2])  # [BATCH]
  mask = np.arange(COMPLETION)[None, :] < lengths[:, None]  # [BATCH, COMPLETION]
  tokens = np.where(mask, rs.randint(1, VOCAB, mask.shape), 0).astype(np.int32)
  behaviour = np.where(mask, -rs.uniform(0.5, 5.0, mask.shape), 0.0).astype(np.float32)
  return Rollout(prompt_tokens=jnp.asarray(batch["prompt_tokens"]),
                 prompt_mask=jnp.asarray(batch["prompt_mask"]),
                 completion_tokens=jnp.asarray(tokens), completion_mask=jnp.asarray(mask),
                 behaviour_logprobs=jnp.asarray(behaviour),
                 policy_version=jnp.asarray(0, jnp.int32))


def full_forward(graphdef, state, rollout):
  """The model's outputs on [prompt | completion], as numpy float64."""
  tokens = jnp.concatenate([rollout.prompt_tokens, rollout.completion_tokens], axis=1)
  mask = jnp.concatenate([rollout.prompt_mask, rollout.completion_mask], axis=1)
  return np.asarray(nnx.merge(graphdef, state)(tokens, mask), np.float64)


def numpy_experience(ref_logits, values_all, score_all, rollout, ppo, kl_coef):
  """KL shaping + GAE + whitening written out with loops, from the models' raw outputs.

  Args:
    ref_logits: [B, P + T, vocab] reference logits; values_all, score_all: [B, P + T].
  """
  mask = np.asarray(rollout.completion_mask)
  tokens = np.asarray(rollout.completion_tokens)
  behaviour = np.asarray(rollout.behaviour_logprobs, np.float64)
  batch, length = mask.shape
  # Position P - 1 + t predicts / evaluates completion token t.
  z = ref_logits[:, PROMPT - 1:PROMPT - 1 + length] / ppo.temperature
  logp = z - z.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  ref_lp = np.where(mask, np.take_along_axis(logp, tokens[..., None], -1)[..., 0], 0.0)
  values = np.where(mask, values_all[:, PROMPT - 1:PROMPT - 1 + length], 0.0)
  lengths = mask.sum(1)
  scores = score_all[np.arange(batch), PROMPT - 1 + lengths]
  d = ref_lp - behaviour
  kl = {"k1": -d, "k3": np.exp(d) - d - 1}[ppo.kl_estimator]
  kl = np.where(mask, kl, 0.0)
  rewards = -kl_coef * kl
  advantages = np.zeros_like(rewards)
  for b in range(batch):
    n = lengths[b]
    if n:
      rewards[b, n - 1] += scores[b]
    next_adv = next_value = 0.0  # the episode ends after the last real token
    for t in reversed(range(n)):
      delta = rewards[b, t] + ppo.gamma * next_value - values[b, t]
      next_adv = delta + ppo.gamma * ppo.lam * next_adv
      advantages[b, t], next_value = next_adv, values[b, t]
  returns = np.where(mask, advantages + values, 0.0)
  valid = advantages[mask]
  white = (advantages - valid.mean()) / np.sqrt(valid.var() + 1e-8)
  return dict(ref_logprobs=ref_lp, values=values, scores=scores, kl=kl, rewards=rewards,
              returns=returns, advantages=np.where(mask, white, 0.0))


@pytest.mark.parametrize("kl_estimator", ["k1", "k3"])
def test_infer_stage_matches_numpy_kl_shaping_gae_whitening(layout, models, kl_estimator):
  ppo = ppo_section(kl_estimator=kl_estimator, gamma=0.9, lam=0.8, temperature=0.7)
  rollout = hand_rollout()
  infer = InferStage(layout, models["actor"][0], models["critic"][0], models["reward"][0],
                     InferSettings.from_settings(ppo, ppo.temperature))
  exp, metrics = infer(models["actor"][1], models["critic"][1], models["reward"][1],
                       rollout, kl_coef=0.3)
  want = numpy_experience(full_forward(*models["actor"], rollout),
                          full_forward(*models["critic"], rollout),
                          full_forward(*models["reward"], rollout), rollout, ppo, 0.3)
  for name, value in want.items():
    np.testing.assert_allclose(np.asarray(getattr(exp, name)), value, atol=1e-5, rtol=1e-5,
                               err_msg=name)
  np.testing.assert_array_equal(exp.old_logprobs, rollout.behaviour_logprobs)
  seq_kl = want["kl"].sum(1).mean()
  np.testing.assert_allclose(float(metrics["kl/mean"]), seq_kl, rtol=1e-5, atol=1e-5)
  # The comparison is not vacuous: KL and the score both shape the rewards.
  assert np.abs(want["kl"]).max() > 0.1 and np.abs(want["scores"]).max() > 1e-3


def test_infer_stage_uses_the_configured_advantage_estimator(layout, models):
  from pipe_rlhf_jax.ppo.registry import ADVANTAGE_ESTIMATORS

  @ADVANTAGE_ESTIMATORS.register("test_monte_carlo")
  def monte_carlo(rewards, values, mask, settings):
    del settings  # undiscounted return-to-go, no bootstrapping from the critic
    returns = jnp.where(mask, jnp.cumsum(rewards[:, ::-1], axis=1)[:, ::-1], 0.0)
    return jnp.where(mask, returns - values, 0.0), returns

  ppo = ppo_section(advantage_estimator="test_monte_carlo", whiten_advantages=False)
  rollout = hand_rollout()
  infer = InferStage(layout, models["actor"][0], models["critic"][0], models["reward"][0],
                     InferSettings.from_settings(ppo, ppo.temperature))
  exp, _ = infer(models["actor"][1], models["critic"][1], models["reward"][1], rollout, 0.3)
  rewards, mask = np.asarray(exp.rewards), np.asarray(rollout.completion_mask)
  want = np.where(mask, np.cumsum(rewards[:, ::-1], axis=1)[:, ::-1], 0.0)
  np.testing.assert_allclose(exp.returns, want, atol=1e-5)
  # GAE with gamma = 1, lam = 0.95 bootstraps from the critic: a different answer.
  gae = InferStage(layout, models["actor"][0], models["critic"][0], models["reward"][0],
                   InferSettings.from_settings(ppo_section(whiten_advantages=False), 1.0))
  exp_gae, _ = gae(models["actor"][1], models["critic"][1], models["reward"][1], rollout,
                   0.3)
  assert np.abs(np.asarray(exp_gae.advantages) - np.asarray(exp.advantages)).max() > 1e-3


def test_standardised_scores_shape_the_rewards_and_stay_raw_in_the_experience(layout,
                                                                              models):
  # reward_shift / reward_scale (the reward model's standardisation) act on the score as
  # the rewards see it: the KL part, the reported scores and reward/mean are unchanged.
  rollout = hand_rollout()

  def experience(**overrides):
    settings = InferSettings.from_settings(ppo_section(whiten_advantages=False, **overrides), 1.0)
    infer = InferStage(layout, models["actor"][0], models["critic"][0], models["reward"][0],
                       settings)
    return infer(models["actor"][1], models["critic"][1], models["reward"][1], rollout, 0.3)

  raw, raw_metrics = experience()
  std, std_metrics = experience(reward_shift=0.3, reward_scale=2.0)
  np.testing.assert_array_equal(std.scores, raw.scores)
  assert float(std_metrics["reward/mean"]) == float(raw_metrics["reward/mean"])
  scores, mask = np.asarray(raw.scores), np.asarray(rollout.completion_mask)
  rows = np.flatnonzero(mask.any(1))  # an all-padding row gets no reward
  last = mask.sum(1)[rows] - 1  # each row's last valid completion token
  want = np.zeros(mask.shape, np.float32)
  want[rows, last] = ((scores - 0.3) / 2.0 - scores)[rows]
  np.testing.assert_allclose(np.asarray(std.rewards) - np.asarray(raw.rewards), want,
                             atol=1e-5)
  assert np.abs(want).max() > 1e-3


def test_unknown_advantage_estimator_names_the_field():
  from pipe_rlhf_jax.config import ExperimentSettings
  import pipe_rlhf_jax.data.rewards  # noqa: F401  (fills REWARD_FUNCTIONS)
  config = tiny_quickstart()
  ExperimentSettings.from_config(config)
  config.ppo.advantage_estimator = "vtrace"
  with pytest.raises(ValueError, match=r"ppo.advantage_estimator='vtrace'.*gae"):
    ExperimentSettings.from_config(config)
  with pytest.raises(ValueError, match=r"advantage estimator 'vtrace'.*ppo.advantage_est"):
    InferSettings.from_settings(config.ppo, config.ppo.temperature)


def generated_experience(layout, models, ppo, seed=0):
  """A rollout sampled by the actor, with random advantages / values / returns."""
  actor_gd, actor = models["actor"]
  sampling = SamplingSettings(max_new_tokens=COMPLETION, temperature=ppo.temperature,
                            top_k=ppo.top_k, top_p=ppo.top_p, eos_id=None)
  rollout, _ = GenerateStage(layout, actor_gd, sampling)(
      actor, prompts(seed), jax.random.key(seed), version=0)
  # Right-pad some rows so that padding is exercised too.
  lengths = jnp.asarray([COMPLETION, 3, 6, 1, COMPLETION, 5, 2, 7])
  mask = rollout.completion_mask & (jnp.arange(COMPLETION)[None] < lengths[:, None])
  behaviour = jnp.where(mask, rollout.behaviour_logprobs, 0.0)
  rollout = rollout.replace(completion_mask=mask, behaviour_logprobs=behaviour)
  rs = np.random.RandomState(seed + 1)
  rand = lambda: jnp.where(mask, jnp.asarray(rs.normal(size=mask.shape), jnp.float32), 0.)
  zeros = jnp.zeros(mask.shape, jnp.float32)
  return Experience(rollout=rollout, old_logprobs=rollout.behaviour_logprobs,
                    ref_logprobs=zeros, values=rand(), scores=zeros[:, 0], rewards=zeros,
                    advantages=rand(), returns=rand(), kl=zeros,
                    kl_coef=jnp.zeros((), jnp.float32))


def test_train_update_on_the_sampling_weights_has_ratio_one(layout, models):
  ppo = ppo_section(temperature=0.8, entropy_coef=0.01)
  exp = generated_experience(layout, models, ppo)
  trainer = train_stage(layout, models, ppo)
  state = trainer.init_state(models["actor"][1], models["critic"][1])
  new_state, metrics = trainer.update(state, exp, jax.random.key(3))
  # Sampler (KV cache) and trainer (full forward) agree on the behaviour log-probs.
  assert abs(float(metrics["ratio_mean"]) - 1.0) < 1e-6
  assert abs(float(metrics["ratio_max"]) - 1.0) < 1e-6
  assert float(metrics["clip_frac"]) == 0.0
  assert abs(float(metrics["approx_kl"])) < 1e-6
  # At ratio 1 the surrogate is -mean(A); the entropy is the tempered policy's.
  mask = np.asarray(exp.rollout.completion_mask)
  np.testing.assert_allclose(float(metrics["policy_loss"]),
                             -np.asarray(exp.advantages)[mask].mean(), atol=1e-6)
  logits = full_forward(*models["actor"], exp.rollout)[:, PROMPT - 1:-1] / ppo.temperature
  logp = logits - logits.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  entropy = -(np.exp(logp) * logp).sum(-1)
  np.testing.assert_allclose(float(metrics["entropy"]), entropy[mask].mean(), rtol=1e-5)
  assert int(new_state.step) == 1 and float(metrics["bad_updates"]) == 0.0


def test_decoupled_update_weights_tokens_by_the_capped_behaviour_ratio(layout, models):
  cap = 1.5
  ppo = ppo_section(loss="decoupled_ppo_clip", behaviour_weight_cap=cap)
  exp = generated_experience(layout, models, ppo, seed=1)
  mask = np.asarray(exp.rollout.completion_mask)
  # An older behaviour policy: log pi_prox - log pi_behaviour = shift, per token.
  shift = np.where(mask, np.resize([-0.7, 0.2, 0.6, -0.1, 0.9], mask.shape), 0.0)
  behaviour = exp.rollout.behaviour_logprobs - jnp.asarray(shift, jnp.float32)
  # old_logprobs are ignored: the proximal policy is the trainer's current actor.
  exp = exp.replace(rollout=exp.rollout.replace(behaviour_logprobs=behaviour),
                    old_logprobs=behaviour)
  trainer = train_stage(layout, models, ppo)
  state = trainer.init_state(models["actor"][1], models["critic"][1])
  _, metrics = trainer.update(state, exp, jax.random.key(4))

  weight = np.exp(shift[mask])
  capped = np.minimum(weight, cap)
  advantages = np.asarray(exp.advantages)[mask]
  assert abs(float(metrics["ratio_mean"]) - 1.0) < 1e-6  # current == proximal
  np.testing.assert_allclose(float(metrics["policy_loss"]),
                             np.mean(-advantages * capped), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(metrics["iw_mean"]), weight.mean(), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["iw_max"]), weight.max(), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["iw_clip_frac"]), np.mean(weight > cap),
                             rtol=1e-6)
  # The cap binds on some tokens and not on others, so the check above is not vacuous.
  assert 0 < np.mean(weight > cap) < 1


# Slow: the stop rule itself is tests/ppo/test_objective.py's, in the default tier.
@pytest.mark.slow
def test_target_kl_stops_the_update_and_keeps_the_steps_before(layout, models):
  # 4 epochs of one minibatch; a tiny target stops at the second step (the first starts
  # at KL 0), so the result is the one-step update's; a huge one stops nothing.
  exp = generated_experience(layout, models, ppo_section(), seed=4)

  def run(epochs, target_kl):
    ppo = ppo_section(epochs=epochs, target_kl=target_kl)
    tx = lambda: make_optimizer(1e-2, total_steps=10)
    trainer = TrainStage(layout, models["actor"][0], models["critic"][0],
                         TrainSettings.from_settings(ppo, ppo.temperature), tx(), tx())
    state = trainer.init_state(models["actor"][1], models["critic"][1])
    return trainer.update(state, exp, jax.random.key(7))

  one_step, one_metrics = run(1, 0.0)
  stopped, metrics = run(4, 1e-6)
  assert float(metrics["early_stop"]) == 1.0 and float(metrics["gradient_steps"]) == 1.0
  for got, want in zip(jax.tree.leaves((stopped.actor, stopped.critic, stopped.actor_opt)),
                       jax.tree.leaves((one_step.actor, one_step.critic,
                                        one_step.actor_opt))):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
  # Its metrics are the means of the two steps that ran: the stopping one moved away.
  assert float(metrics["kl_from_start"]) > 1.5e-6 / 2
  assert "early_stop" not in one_metrics

  free, free_metrics = run(4, 1e3)
  plain, _ = run(4, 0.0)
  assert float(free_metrics["early_stop"]) == 0.0
  assert float(free_metrics["gradient_steps"]) == 4.0
  for got, want in zip(jax.tree.leaves(free.actor), jax.tree.leaves(plain.actor)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
  # Not vacuous: four steps went further than one.
  moved_by = lambda st: sum(float(jnp.abs(a - b).sum()) for a, b in zip(
      jax.tree.leaves(st.actor), jax.tree.leaves(models["actor"][1])))
  assert moved_by(plain) > 1.5 * moved_by(one_step)


@pytest.mark.parametrize("loss", ["ppo_clip", pytest.param("decoupled_ppo_clip",
                                                             marks=pytest.mark.slow)])
def test_proximal_kl_policy_rederives_the_targets_at_the_trainers_actor(layout, models,
                                                                       loss):
  # A stale rollout: the inference stage penalised the behaviour policy's KL; with
  # kl_policy="proximal" the trainer takes it again at its own (moved) actor and
  # re-derives rewards, GAE and whitening, as numpy does from that actor's log-probs.
  cap, kl_coef = 2.0, 0.3
  rollout = hand_rollout()
  actor_gd, ref = models["actor"]
  actor = moved(ref, seed=3, scale=0.3)  # the trainer's actor, versions ahead

  def first_step(kl_policy):
    ppo = ppo_section(loss=loss, kl_policy=kl_policy, behaviour_weight_cap=cap)
    infer = InferStage(layout, actor_gd, models["critic"][0], models["reward"][0],
                       InferSettings.from_settings(ppo, ppo.temperature))
    exp, _ = infer(ref, models["critic"][1], models["reward"][1], rollout, kl_coef)
    trainer = train_stage(layout, models, ppo)
    state = trainer.init_state(actor, models["critic"][1])
    return trainer.update(state, exp, jax.random.key(6))[1]

  proximal = full_forward(actor_gd, actor, rollout)[:, PROMPT - 1:-1]
  logp = proximal - proximal.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  mask = np.asarray(rollout.completion_mask)
  tokens = np.asarray(rollout.completion_tokens)
  prox_lp = np.where(mask, np.take_along_axis(logp, tokens[..., None], -1)[..., 0], 0.0)
  at_prox = rollout.replace(behaviour_logprobs=jnp.asarray(prox_lp, jnp.float32))
  want = numpy_experience(full_forward(actor_gd, ref, rollout),
                          full_forward(*models["critic"], rollout),
                          full_forward(*models["reward"], rollout), at_prox,
                          ppo_section(), kl_coef)
  advantages = want["advantages"][mask]
  # The first minibatch is the batch at the initial weights: the surrogate at ratio
  # pi / pi_old, where pi_old is the behaviour policy (ppo_clip) or pi itself (decoupled,
  # whose behaviour weight pi / pi_behaviour is capped).
  weight = np.exp(prox_lp - np.asarray(rollout.behaviour_logprobs))[mask]
  if loss == "ppo_clip":
    surrogate = np.minimum(weight * advantages, np.clip(weight, 0.8, 1.2) * advantages)
  else:
    surrogate = np.minimum(weight, cap) * advantages
  metrics = first_step("proximal")
  np.testing.assert_allclose(float(metrics["policy_loss"]), -surrogate.mean(), rtol=1e-4,
                             atol=1e-5)
  np.testing.assert_allclose(float(metrics["kl_proximal/mean"]), want["kl"].sum(1).mean(),
                             rtol=1e-5, atol=1e-5)
  # Not vacuous: the behaviour policy's targets give another loss.
  behaviour = first_step("behaviour")
  assert abs(float(behaviour["policy_loss"]) - float(metrics["policy_loss"])) > 1e-3
  if loss == "decoupled_ppo_clip":  # the proximal log-probs exist, so the lag is shown
    assert float(behaviour["kl_proximal/mean"]) == pytest.approx(
        float(metrics["kl_proximal/mean"]), rel=1e-6)
  else:
    assert "kl_proximal/mean" not in behaviour


@pytest.mark.parametrize("kl_coef", [0.3, 0.0])
def test_critic_free_infer_stage_groups_scores_and_keeps_kl_out_of_the_rewards(
    layout, models, kl_coef):
  # GRPO over 2 groups of 4, KL in the loss: the rewards are the score alone, the
  # advantages the group-normalised scores; kl_coef=0 runs no reference at all.
  ppo = ppo_section(advantage_estimator="grpo", group_size=4, whiten_advantages=False,
                    kl_in="loss", kl_estimator="k3", temperature=0.7)
  rollout = hand_rollout()
  infer = InferStage(layout, models["actor"][0], None, models["reward"][0],
                     InferSettings.from_settings(ppo, ppo.temperature))
  ref = models["actor"][1] if kl_coef else None
  exp, metrics = infer(ref, None, models["reward"][1], rollout, kl_coef)
  want = numpy_experience(full_forward(*models["actor"], rollout),
                          np.zeros((BATCH, PROMPT + COMPLETION)),
                          full_forward(*models["reward"], rollout), rollout,
                          ppo_section(kl_estimator="k3", temperature=0.7), 0.0)
  mask = np.asarray(rollout.completion_mask)
  # R_i = the sum of the row's rewards: its score, or 0 for the all-padding row 3 (no
  # token for the score to land on).
  groups = want["rewards"].sum(1).reshape(2, 4)
  adv = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True)
                                                     + 1e-6)
  np.testing.assert_allclose(exp.advantages, np.where(mask, adv.reshape(-1)[:, None], 0.0),
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(exp.rewards, want["rewards"], rtol=1e-5, atol=1e-6)
  assert exp.values is None and "value/mean" not in metrics
  if kl_coef:
    np.testing.assert_allclose(exp.kl, want["kl"], rtol=1e-5, atol=1e-5)
    assert np.abs(want["kl"]).max() > 0.1  # there is a KL, and it is not in the rewards
  else:
    assert exp.ref_logprobs is None and exp.kl is None and "kl/mean" not in metrics
  with pytest.raises(ValueError, match="'grpo' takes no critic"):
    InferStage(layout, models["actor"][0], models["critic"][0], models["reward"][0],
               InferSettings.from_settings(ppo, ppo.temperature))


# The other aggregations in the slow tier: each is the same stage and test with another
# formula, and tests/ppo/test_algorithms.py checks every formula in the default run.
@pytest.mark.parametrize("loss_agg", ["token_mean", *(pytest.param(a, marks=pytest.mark.slow)
                                                     for a in ("seq_mean_token_mean",
                                                               "token_sum_norm"))])
def test_critic_free_update_aggregates_and_adds_the_kl_loss(layout, models, loss_agg):
  ppo = ppo_section(advantage_estimator="grpo", group_size=4, whiten_advantages=False,
                    kl_in="loss", kl_estimator="k3", kl_coef=0.5, loss_agg=loss_agg,
                    temperature=0.8)
  exp = generated_experience(layout, models, ppo, seed=2)
  mask = np.asarray(exp.rollout.completion_mask)
  # A reference below the sampling policy by a known shift per token: d = ref - logp.
  shift = np.where(mask, np.resize([0.4, -0.3, 0.9, 0.1], mask.shape), 0.0)
  exp = exp.replace(ref_logprobs=exp.rollout.behaviour_logprobs - shift, values=None,
                    returns=None)
  tx = make_optimizer(1e-3, total_steps=10)
  trainer = TrainStage(layout, models["actor"][0], None,
                       TrainSettings.from_settings(ppo, ppo.temperature), tx, None)
  state = trainer.init_state(models["actor"][1])
  assert state.critic is None and state.critic_opt is None
  new_state, metrics = trainer.update(state, exp, jax.random.key(5))

  def agg(x):  # the hand aggregation over the one minibatch (= the batch)
    x = np.where(mask, x, 0.0)
    if loss_agg == "token_mean":
      return x.sum() / mask.sum()
    if loss_agg == "seq_mean_token_mean":
      return np.mean(x.sum(1) / mask.sum(1))
    return x.sum() / (BATCH * COMPLETION)

  d = -shift  # ref - current, the current policy being the sampling one (ratio 1)
  k3 = np.exp(d) - d - 1
  assert abs(float(metrics["ratio_mean"]) - 1.0) < 1e-6
  np.testing.assert_allclose(float(metrics["policy_loss"]), agg(-np.asarray(exp.advantages)),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(metrics["kl_loss"]), agg(k3), rtol=1e-5, atol=1e-6)
  assert "value_loss" not in metrics and new_state.critic is None


def demo_batch(shape, seed=0):
  """A PtxBatch of random demonstrations with leading dims `shape` ([E, M, R])."""
  rs = np.random.RandomState(seed)
  rows = int(np.prod(shape))
  p_len = 1 + np.arange(rows) % PROMPT
  c_len = 1 + np.arange(rows) % COMPLETION
  p_mask = np.arange(PROMPT)[None, :] >= PROMPT - p_len[:, None]  # left-padded
  c_mask = np.arange(COMPLETION)[None, :] < c_len[:, None]  # right-padded
  fields = dict(prompt_tokens=np.where(p_mask, rs.randint(1, VOCAB, p_mask.shape), 0),
                prompt_mask=p_mask,
                completion_tokens=np.where(c_mask, rs.randint(1, VOCAB, c_mask.shape), 0),
                completion_mask=c_mask)
  return PtxBatch(**{k: jnp.asarray(v.reshape(*shape, *v.shape[1:]),
                                    bool if k.endswith("mask") else jnp.int32)
                     for k, v in fields.items()})


# Slow: the term's coefficient is tests/ppo/test_objective.py's and a PPO-ptx system's
# training tests/system/test_critic_free.py's, both in the default tier.
@pytest.mark.slow
def test_ptx_term_is_the_sft_loss_and_its_gradient_step(layout, models):
  # PPO-ptx with zero advantages: the surrogate has no gradient, so the actor's update is
  # one optimizer step of ptx_coef x the SFT phase's own loss on the demonstrations given.
  coef, rows = 0.7, 4
  ppo = ppo_section(ptx_coef=coef, ptx_rows=rows)
  exp = generated_experience(layout, models, ppo, seed=5)
  exp = exp.replace(advantages=jnp.zeros_like(exp.advantages))
  lr = 1e-2
  tx = lambda: make_optimizer(lr, total_steps=10)
  trainer = TrainStage(layout, models["actor"][0], models["critic"][0],
                       TrainSettings.from_settings(ppo, ppo.temperature), tx(), tx())
  assert trainer.ptx_shape(BATCH) == (1, 1, rows)
  demos = demo_batch((1, 1, rows))
  actor_gd, actor = models["actor"]
  state = trainer.init_state(actor, models["critic"][1])
  new, metrics = trainer.update(state, exp, jax.random.key(8), demos)

  flat = {k: v[0, 0] for k, v in vars(demos).items()}
  (nll, _), grads = jax.value_and_grad(supervised.sft_loss(actor_gd), has_aux=True)(
      actor, flat)
  np.testing.assert_allclose(float(metrics["ptx_loss"]), float(nll), rtol=1e-6)
  opt = tx()
  updates, _ = opt.update(jax.tree.map(lambda g: coef * g, grads), opt.init(actor), actor)
  want = optax.apply_updates(actor, updates)
  # Adam divides each gradient by its own magnitude, so float-order differences in tiny
  # gradients show up at ~1e-4 of the step (lr): the bound is 1e-3 of it.
  for got, expect in zip(jax.tree.leaves(new.actor), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(expect), rtol=0, atol=1e-3 * lr)
  assert float(metrics["policy_loss"]) == 0.0
  # Not vacuous: the step moved the actor.
  assert any(float(jnp.abs(a - b).max()) > 1e-4
             for a, b in zip(jax.tree.leaves(new.actor), jax.tree.leaves(actor)))


def test_ptx_batch_must_match_the_setting(layout, models):
  exp = generated_experience(layout, models, ppo_section(), seed=6)
  plain = train_stage(layout, models, ppo_section())
  state = plain.init_state(models["actor"][1], models["critic"][1])
  with pytest.raises(ValueError, match="ptx_coef=0.0 takes no demonstrations"):
    plain.update(state, exp, jax.random.key(0), demo_batch((1, 1, 2)))
  ppo = ppo_section(ptx_coef=0.5, ptx_rows=4, epochs=2)
  trainer = train_stage(layout, models, ppo)
  state = trainer.init_state(models["actor"][1], models["critic"][1])
  with pytest.raises(ValueError, match="ptx_coef=0.5 needs demonstrations"):
    trainer.update(state, exp, jax.random.key(0))
  with pytest.raises(ValueError, match=r"this update needs \(2, 1, 4\)"):
    trainer.update(state, exp, jax.random.key(0), demo_batch((1, 1, 4)))


@pytest.mark.parametrize("decoder", ["engine", pytest.param("pipelined", marks=pytest.mark.slow)])
def test_continuous_batching_stage_gives_the_static_stages_rollout(models, decoder):
  # Groups of 2, a frequent token as EOS and per-prompt budgets: rows end at different
  # steps. The engine runs 3 slots on a tensor-parallel mesh; the pipelined decoder 2
  # stages x 2 micro-batches of 2 rows, refilled load by load. The rollout is the
  # static stage's.
  layout = StageLayout("generate", make_mesh({"data": 1, "tensor": 2}, jax.devices()[:2]),
                       logical.DEFAULT_RULES)
  actor_gd, actor = models["actor"]
  batch = dict(prompts(seed=3), max_new_tokens=np.array([8, 2, 5, 1, 8, 3, 6, 4]))
  rng = jax.random.key(5)
  sampling = SamplingSettings(max_new_tokens=COMPLETION, temperature=1.0, eos_id=None)
  probe, _ = GenerateStage(layout, actor_gd, sampling, group_size=2)(actor, batch, rng, 0)
  eos = int(np.bincount(np.asarray(probe.completion_tokens).ravel()).argmax())
  sampling = SamplingSettings(max_new_tokens=COMPLETION, temperature=1.0, eos_id=eos)
  static, _ = GenerateStage(layout, actor_gd, sampling, group_size=2)(actor, batch, rng, 3)
  if decoder == "engine":
    stage = GenerateStage(layout, actor_gd, sampling, group_size=2, num_slots=3)
  else:
    layout = StageLayout("generate", make_mesh({"pipeline": 2}, jax.devices()[:2]),
                         logical.STAGE_RULES["generate"])
    stage = GenerateStage(layout, actor_gd, sampling, group_size=2, num_microbatches=2,
                          num_slots=4)
  engine, metrics = stage(actor, batch, rng, 3)
  lengths = np.asarray(static.completion_mask).sum(1)
  assert lengths.min() < COMPLETION < lengths.max() + 1  # EOS ends some rows early
  for field in ("prompt_tokens", "prompt_mask", "completion_tokens", "completion_mask"):
    np.testing.assert_array_equal(np.asarray(getattr(engine, field)),
                                  np.asarray(getattr(static, field)), err_msg=field)
  np.testing.assert_allclose(np.asarray(engine.behaviour_logprobs),
                             np.asarray(static.behaviour_logprobs), atol=2e-5)
  assert 0 < metrics["generate/slot_occupancy"] <= 1
  if decoder == "engine":
    # The trace's slot lanes: every completion that decoded past its prefill's token is
    # one bar, on one slot, as long as its decode steps; bars of a slot never overlap;
    # their busy slot-steps are the occupancy's.
    tracer = Tracer()
    tracer.add("generate", 10.0, 12.0, batch=3)
    stage.trace_slots(tracer, batch=3)
    bars = [bar for _, _, bar in tracer.lanes("generate")]
    decoded = sorted(int(k) for k in np.flatnonzero(lengths > 1))
    assert sorted(b.args["completion"] for b in bars) == decoded
    for k in decoded:
      bar = next(b for b in bars if b.args["completion"] == k)
      lo, hi = bar.args["decode_steps"]
      assert hi - lo == lengths[k] - 1
    per_lane = {}
    for stage_name, lane, bar in tracer.lanes("generate"):
      per_lane.setdefault(lane, []).append(bar)
    assert len(per_lane) <= 3
    for lane_bars in per_lane.values():
      assert all(a.end <= b.start + 1e-9 for a, b in zip(lane_bars, lane_bars[1:]))
    steps = stage.slot_timeline.decode_steps
    busy = sum(b.args["decode_steps"][1] - b.args["decode_steps"][0] for b in bars)
    assert busy / (steps * 3) == pytest.approx(metrics["generate/slot_occupancy"])
    assert all(10.0 <= b.start <= b.end <= 12.0 + 1e-9 for b in bars)
