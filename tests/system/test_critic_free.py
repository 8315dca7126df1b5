"""The system builds only the models its algorithm needs: no critic for a critic-free
estimator, no reference for kl_coef=0; checkpoints hold nothing of a missing model."""

import jax
import numpy as np
import pytest

from pipe_rlhf_jax import models
from pipe_rlhf_jax.checkpoint import Checkpointer
from pipe_rlhf_jax.config import Plan, PPOSettings
from pipe_rlhf_jax.generation import SamplingSettings
from pipe_rlhf_jax.system import Models, PPOSystem, prompts_from_texts, run
from tests.helpers.hf_helpers import write_tiny_llama

GRPO = dict(advantage_estimator="grpo", group_size=4, whiten_advantages=False)
TEXTS = [f"rev {w}=" for w in ("ab", "ba", "abc", "cab", "bca", "a", "hg", "gfe")]


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory):
  return write_tiny_llama(tmp_path_factory.mktemp("m"))


def system_for(path, ppo, ptx_demos=None, **model_kwargs):
  tok = models.load_tokenizer(path)
  return PPOSystem(
      Models.from_policy(models.from_pretrained(path), **model_kwargs),
      ppo=PPOSettings(steps=4, batch_size=8, minibatch_size=4, actor_lr=1e-3, **ppo),
      sampling=SamplingSettings(max_new_tokens=4, eos_id=tok.eos_id, pad_id=tok.pad_id),
      plan=Plan(), reward_fn=lambda p, c: [len(set(x)) for x in c],
      decode=tok.decode, ptx_demos=ptx_demos), tok


def leaf_paths(tree):
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_critic_free_system_has_no_critic_anywhere_and_resumes_exactly(policy_path, tmp_path):
  system, tok = system_for(policy_path, GRPO, critic_from=None)
  assert not system.has_critic and system.state.critic is None
  assert system.state.critic_opt is None and system.critic_for_inference()[0] is None
  paths = leaf_paths(system.checkpoint_state())
  assert paths and not any("critic" in p for p in paths)
  assert system.reference is not None  # kl_coef > 0 keeps the reference

  # Two steps, a checkpoint, two more; against four uninterrupted steps.
  prompts = prompts_from_texts(TEXTS, tok, 2, 8)  # 2 prompts x 4 samples = batch 8
  first = run(system, prompts, steps=2)
  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.save(1, system.checkpoint_state(),
            metadata={**system.checkpoint_metadata(), "data": first.data_state})
  rest = run(system, prompts, steps=2).metrics

  fresh, _ = system_for(policy_path, GRPO, critic_from=None)
  state, meta = ckpt.restore(target=fresh.abstract_checkpoint_state())
  ckpt.close()
  fresh.restore(state, meta)
  resumed_prompts = prompts_from_texts(TEXTS, tok, 2, 8)
  resumed_prompts.set_state(meta["data"])
  resumed = run(fresh, resumed_prompts, steps=2).metrics
  for want, got in zip(rest, resumed):
    for key in ("reward/mean", "kl/mean", "policy_loss", "kl_coef", "entropy"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7, err_msg=key)
  assert all(m["reward/std"] > 0 and "value_loss" not in m for m in first.metrics + rest)
  assert "staleness/critic" not in rest[0] and "transfer/critic_sync/bytes" not in rest[0]


def test_kl_coef_zero_builds_and_runs_no_reference(policy_path):
  # REINFORCE++ with one sample per prompt: neither critic nor reference nor groups.
  ppo = dict(advantage_estimator="reinforce_pp", whiten_advantages=False, kl_coef=0.0)
  system, tok = system_for(policy_path, ppo, critic_from=None, reference=False)
  assert system.reference is None and not system.has_critic
  metrics = run(system, prompts_from_texts(TEXTS, tok, 8, 8), steps=1).metrics[0]
  assert "kl/mean" not in metrics and "kl_loss" not in metrics
  assert np.isfinite(metrics["policy_loss"])


@pytest.mark.parametrize("ppo, model_kwargs, message", [
    (GRPO, {}, r"'grpo' uses no critic but Models has one.*critic_from=None"),
    ({}, dict(critic_from=None), r"'gae' needs a critic but Models has none"),
    ({"kl_coef": 0.0}, {}, r"ppo.kl_coef=0 uses no reference.*reference=False"),
    ({}, dict(reference=False), r"ppo.kl_coef=0.05 needs the reference policy"),
])
def test_models_that_do_not_match_the_algorithm_are_refused(policy_path, ppo, model_kwargs,
                                                            message):
  with pytest.raises(ValueError, match=message):
    system_for(policy_path, ppo, **model_kwargs)


def test_a_prompt_batch_of_the_wrong_size_names_the_group_arithmetic(policy_path):
  system, tok = system_for(policy_path, GRPO, critic_from=None)
  with pytest.raises(ValueError, match=r"ppo.batch_size / ppo.group_size = 8 / 4 = 2"):
    run(system, prompts_from_texts(TEXTS, tok, 8, 8), steps=1)


def demo_pool(rows=5):
  """Distinct demonstrations: row i's prompt is i + 1 tokens long, its completion 2."""
  prompt_mask = np.arange(6)[None, :] >= 6 - (1 + np.arange(rows))[:, None]
  return dict(prompt_tokens=np.where(prompt_mask, 3 + np.arange(rows)[:, None], 0),
              prompt_mask=prompt_mask, completion_tokens=np.full((rows, 2), 7, np.int32),
              completion_mask=np.ones((rows, 2), bool))


def test_ptx_system_trains_on_rows_keyed_by_seed_and_step(policy_path):
  ptx = dict(ptx_coef=0.5, ptx_batch_size=8)  # the 8 data shards of the one mesh
  system, tok = system_for(policy_path, {**GRPO, **ptx}, demo_pool(), critic_from=None)
  batch = system.ptx_batch(3)
  # One epoch of 8 / 4 = 2 minibatches, 8 demonstrations each.
  assert batch.prompt_tokens.shape == (1, 2, 8, 6)
  again, _ = system_for(policy_path, {**GRPO, **ptx}, demo_pool(), critic_from=None)
  for got, want in zip(jax.tree.leaves(again.ptx_batch(3)), jax.tree.leaves(batch)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert not np.array_equal(np.asarray(system.ptx_batch(4).prompt_mask),
                            np.asarray(batch.prompt_mask))
  metrics = run(system, prompts_from_texts(TEXTS, tok, 2, 8), steps=2).metrics
  assert all(np.isfinite(m["ptx_loss"]) and m["ptx_loss"] > 0 for m in metrics)


def test_ptx_rows_default_to_the_minibatch_rounded_up_to_the_batch_shards(policy_path):
  # A minibatch of 4 on the 8 data shards of the one mesh: the default draws 8 rows per
  # gradient step, so it splits; an explicit 4 does not, and is refused naming the field.
  system, _ = system_for(policy_path, {**GRPO, "ptx_coef": 0.5}, demo_pool(),
                         critic_from=None)
  assert system.ptx_batch(0).prompt_tokens.shape == (1, 2, 8, 6)
  with pytest.raises(ValueError, match=r"ppo.ptx_batch_size: 4 demonstrations per gradient "
                                       r"step do not split over the 8 batch shards"):
    system_for(policy_path, {**GRPO, "ptx_coef": 0.5, "ptx_batch_size": 4}, demo_pool(),
               critic_from=None)


def test_ptx_demonstrations_are_given_exactly_with_the_sft_term(policy_path):
  demos = demo_pool()
  with pytest.raises(ValueError, match="ptx_demos given with ppo.ptx_coef=0"):
    system_for(policy_path, GRPO, demos, critic_from=None)
  ptx = {**GRPO, "ptx_coef": 0.5}
  with pytest.raises(ValueError, match=r"ppo.ptx_coef=0.5 needs demonstrations"):
    system_for(policy_path, ptx, critic_from=None)
  with pytest.raises(ValueError, match=r"ptx_demos lacks \['completion_mask'\]"):
    system_for(policy_path, ptx, {k: v for k, v in demos.items() if k != "completion_mask"},
               critic_from=None)
  bad = {**demos, "completion_mask": np.zeros((5, 2), bool)}
  with pytest.raises(ValueError, match="each with a completion token"):
    system_for(policy_path, ptx, bad, critic_from=None)
