"""Packed training: a PPO update over each minibatch packed into rows of L tokens is the
padded update (parameters and metrics), with a critic and without, for each loss
aggregation; the setting is refused where a row cannot hold a sequence.
"""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pipe_rlhf_jax.config import MeshSpec, Plan, StagePlan
from pipe_rlhf_jax.models.config import tiny_config
from pipe_rlhf_jax.models.transformer import init_model
from pipe_rlhf_jax.parallel import logical
from pipe_rlhf_jax.parallel.mesh import make_mesh
from pipe_rlhf_jax.ppo.types import Rollout
from pipe_rlhf_jax.stages import packing
from pipe_rlhf_jax.stages.common import StageLayout, completion_logprobs
from pipe_rlhf_jax.stages.infer import InferSettings, InferStage
from pipe_rlhf_jax.stages.train import PACK_FILL_KEY, TrainSettings, TrainStage
from pipe_rlhf_jax.system import prompts_from_texts, run
from tests.stages.test_packing import COMPLETION, PROMPT, VOCAB, padded_batch
from tests.stages.test_ppo_stages import moved, ppo_section
from tests.system.test_api import _tiny_system

BATCH = 16


@pytest.fixture(scope="module")
def layout():
  return StageLayout("train", make_mesh({"data": 1}, jax.devices()[:1]),
                     logical.DEFAULT_RULES)


@pytest.fixture(scope="module")
def models():
  config = tiny_config(vocab_size=VOCAB, embed_dim=32, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp_dim=64, dtype="float32",
                       logits_chunk_size=4)
  return {name: nnx.split(init_model(config.replace(head=head), seed=seed))
          for seed, (name, head) in enumerate((("actor", "lm"), ("critic", "value"),
                                               ("reward", "score")))}


def experience(layout, models, ppo, spare_columns=0):
  """Experience of a varied-length batch (an empty and a full completion among them),
  sampled by a policy a little away from the actor, made by the padded inference stage;
  `spare_columns` more padding columns after the completions."""
  prompt_tokens, prompt_mask, completion_tokens, completion_mask = padded_batch(
      seed=3, batch=BATCH)
  prompt_tokens, prompt_mask, completion_tokens, completion_mask = map(jnp.asarray, (
      prompt_tokens, prompt_mask, np.pad(completion_tokens, ((0, 0), (0, spare_columns))),
      np.pad(completion_mask, ((0, 0), (0, spare_columns)))))
  actor_gd, actor = models["actor"]
  behaviour = completion_logprobs(actor_gd, moved(actor, seed=5, scale=0.2), prompt_tokens,
                                  prompt_mask, completion_tokens, completion_mask,
                                  temperature=ppo.temperature)
  rollout = Rollout(prompt_tokens, prompt_mask, completion_tokens, completion_mask,
                    behaviour, jnp.asarray(0, jnp.int32))
  settings = InferSettings.from_settings(ppo, ppo.temperature)
  critic = models["critic"] if settings.needs_critic else (None, None)
  infer = InferStage(layout, actor_gd, critic[0], models["reward"][0], settings)
  exp, _ = infer(actor, critic[1], models["reward"][1], rollout, ppo.kl_coef)
  return exp


def updates(layout, models, ppo, budget, spare_columns=0):
  """(state, metrics) of one update padded, then packed into rows of `budget`; plain SGD,
  whose step is linear in the gradient (Adam's first step is about lr x its sign, which
  float rounding flips where a gradient is ~0)."""
  exp = experience(layout, models, ppo, spare_columns)
  settings = TrainSettings.from_settings(ppo, ppo.temperature)
  needs_critic = InferSettings.from_settings(ppo, ppo.temperature).needs_critic
  critic_gd, critic = models["critic"] if needs_critic else (None, None)
  if critic is not None:
    # A critic that has trained since the rollout was scored, its values more than
    # `value_clip_eps` from the old ones: on an unclipped token `value_clip_frac`
    # compares (v - R)^2 with (old + (v - old) - R)^2, a tie float rounding decides.
    critic = moved(critic, seed=6, scale=0.1)
  out = []
  for pack in (0, budget):
    tx = lambda: optax.sgd(0.5)
    trainer = TrainStage(layout, models["actor"][0], critic_gd, settings, tx(),
                         tx() if critic_gd is not None else None, pack_tokens=pack)
    state = trainer.init_state(models["actor"][1], critic)
    state, metrics = trainer.update(state, exp, jax.random.key(7))
    out.append((state, {k: float(v) for k, v in metrics.items()}))
  return out


def assert_same_update(padded, packed):
  (want_state, want), (got_state, got) = padded, packed
  assert 0 < got.pop(PACK_FILL_KEY) <= 1
  assert sorted(got) == sorted(want)
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=2e-4, atol=1e-6, err_msg=key)
  assert want["bad_updates"] == 0
  for a, b in zip(jax.tree.leaves((want_state.actor, want_state.critic)),
                  jax.tree.leaves((got_state.actor, got_state.critic))):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


# Slow: the critic-free test below packs the update in the default run, and
# tests/stages/test_packing.py the critic's packed values.
@pytest.mark.slow
@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_a_packed_update_with_a_critic_is_the_padded_one(layout, models, loss_agg):
  # GAE with its critic, two epochs of two minibatches, the entropy bonus on: 24 columns
  # hold one or two sequences of up to 16 tokens.
  ppo = ppo_section(minibatch_size=8, epochs=2, entropy_coef=0.01, loss_agg=loss_agg,
                    temperature=0.8, value_clip_eps=1e-3)
  assert_same_update(*updates(layout, models, ppo, budget=24))


def test_a_packed_critic_free_update_keeps_its_groups(layout, models):
  # GRPO over groups of 4 with its KL in the loss and the decoupled loss (the proximal
  # pass, packed over the whole batch); sequence-mean aggregation; rows of one sequence's
  # padded width, completions padded to 4 x their longest.
  ppo = ppo_section(advantage_estimator="grpo", group_size=4, minibatch_size=8,
                    kl_in="loss", kl_estimator="k3", loss="decoupled_ppo_clip",
                    loss_agg="seq_mean_token_mean")
  assert_same_update(*updates(layout, models, ppo, budget=PROMPT + COMPLETION,
                              spare_columns=3 * COMPLETION))


def test_every_minibatch_is_packed_to_one_row_count():
  _, prompt_mask, _, completion_mask = padded_batch(seed=3, batch=BATCH)
  index = np.random.RandomState(0).permutation(BATCH).reshape(2, 2, 4)  # [E, M, mb]
  plans = packing.plan_minibatches(prompt_mask, completion_mask, index, 40, row_multiple=2)
  assert plans.source.shape[:2] == (2, 2) and plans.source.shape[3] == 40
  assert plans.completion_rows.shape == (2, 2, 4, COMPLETION)
  for e in range(2):
    for m in range(2):
      rows = index[e, m]
      alone = packing.plan_packing(prompt_mask[rows], completion_mask[rows], 40, 2)
      got = jax.tree.map(lambda x: x[e, m], plans)
      np.testing.assert_array_equal(got.completion_cols, alone.completion_cols)
      np.testing.assert_array_equal(got.source[:len(alone.source)], alone.source)
      assert not got.segment_ids[len(alone.source):].any()  # the spare rows are empty
      # The LM head's entries likewise: the minibatch's own, then spare ones.
      entries = len(alone.head_index)
      np.testing.assert_array_equal(got.head_index[:entries], alone.head_index)
      np.testing.assert_array_equal(got.completion_slot, alone.completion_slot)
      assert not got.head_index[entries:].any()


def test_a_row_shorter_than_a_sequence_is_refused_naming_the_setting(layout, models):
  ppo = ppo_section(minibatch_size=8)
  exp = experience(layout, models, ppo)
  tx = optax.sgd(0.1)
  trainer = TrainStage(layout, models["actor"][0], models["critic"][0],
                       TrainSettings.from_settings(ppo, 1.0), tx, tx, pack_tokens=12)
  state = trainer.init_state(models["actor"][1], models["critic"][1])
  with pytest.raises(ValueError, match=r"stages.train.pack_tokens=12: sequence \d+ has 1[3-6] "
                                       r"real tokens .*set stages.train.pack_tokens to at "
                                       r"least 1[3-6]"):
    trainer.update(state, exp, jax.random.key(0))
  with pytest.raises(ValueError, match="stages.train.pack_tokens=-1"):
    TrainStage(layout, models["actor"][0], None, TrainSettings.from_settings(ppo, 1.0), tx, None,
               pack_tokens=-1)


def test_pack_tokens_is_a_training_setting():
  plan = Plan(train=StagePlan(mesh=MeshSpec(data=1, fsdp=-1), pack_tokens=256))
  assert plan.train.pack_tokens == 256
  assert StagePlan.from_config({"pack_tokens": 64}, "stages.train").pack_tokens == 64
  with pytest.raises(ValueError, match="stages.train.pack_tokens=-2"):
    StagePlan.from_config({"pack_tokens": -2}, "stages.train")


def test_the_system_hands_the_setting_to_its_training_stage(tmp_path):
  train = StagePlan(mesh=MeshSpec(data=1, fsdp=-1), pack_tokens=16)
  system, _ = _tiny_system(tmp_path, train=train)
  assert system.train_stage.pack_tokens == 16 and system.infer_stage.pack_tokens == 0


@pytest.mark.slow
def test_packed_training_changes_how_not_what(tmp_path):
  # Two PPO steps through the public API, the training stage padded and packed into rows
  # of 16 tokens (8 prompt + 4 completion columns a sequence), over its 8 devices.
  results = []
  for plan in (StagePlan(mesh=MeshSpec(data=1, fsdp=-1)),
               StagePlan(mesh=MeshSpec(data=1, fsdp=-1), pack_tokens=16)):
    system, tok = _tiny_system(tmp_path, train=plan)
    prompts = prompts_from_texts([f"rev {w}=" for w in "abcdefgh"], tok, 8, 8)
    results.append(run(system, prompts, steps=2).metrics)
  for want, got in zip(*results):
    assert 0 < got[PACK_FILL_KEY] <= 1 and PACK_FILL_KEY not in want
    for key in ("reward/mean", "kl/mean", "value/mean", "policy_loss", "value_loss",
                "entropy", "actor_grad_norm", "critic_grad_norm", "approx_kl"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6, err_msg=key)
