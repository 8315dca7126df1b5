"""Packed inference: the plan is a valid packing, and packed forward passes give the
padded layout's outputs (reference log-probs, critic values, reward scores, a PPO step).
"""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipe_rlhf_jax.config import StagePlan
from pipe_rlhf_jax.models.config import tiny_config
from pipe_rlhf_jax.models.transformer import init_model, segment_positions
from pipe_rlhf_jax.stages import packing
from pipe_rlhf_jax.stages.common import (
  completion_logprobs,
  completion_values,
  packed_completion_logprobs,
  packed_completion_values,
  packed_sequence_scores,
  sequence_scores,
)
from pipe_rlhf_jax.system import prompts_from_texts, run
from tests.system.test_api import _tiny_system

VOCAB, PROMPT, COMPLETION = 64, 6, 10


def padded_batch(seed=0, batch=8):
  """Host arrays of a padded batch: prompts of 1..PROMPT real tokens, completions of
  0..COMPLETION (the empty and the full-length one always among them)."""
  rs = np.random.RandomState(seed)
  prompt_counts = rs.randint(1, PROMPT + 1, batch)
  completion_counts = rs.randint(0, COMPLETION + 1, batch)
  completion_counts[:2] = (0, COMPLETION)
  prompt_mask = np.arange(PROMPT) >= PROMPT - prompt_counts[:, None]
  completion_mask = np.arange(COMPLETION) < completion_counts[:, None]
  # Padding holds tokens too: a packed pass must never read them.
  prompt_tokens = rs.randint(1, VOCAB, (batch, PROMPT)).astype(np.int32)
  completion_tokens = rs.randint(1, VOCAB, (batch, COMPLETION)).astype(np.int32)
  return prompt_tokens, prompt_mask, completion_tokens, completion_mask


@pytest.mark.parametrize("row_multiple", [1, 4])
@pytest.mark.parametrize("budget", [PROMPT + COMPLETION, 40])
def test_the_plan_places_every_real_token_once_in_order(budget, row_multiple):
  prompt_tokens, prompt_mask, completion_tokens, completion_mask = padded_batch(batch=16)
  plan = packing.plan_packing(prompt_mask, completion_mask, budget, row_multiple)
  rows = plan.source.shape[0]
  assert plan.source.shape == (rows, budget) and rows % row_multiple == 0
  assert rows <= 16
  tokens = np.concatenate([prompt_tokens, completion_tokens], axis=1)
  real = np.concatenate([prompt_mask, completion_mask], axis=1)
  placed = plan.source[plan.segment_ids != 0]
  # Every real token exactly once, nothing else.
  np.testing.assert_array_equal(np.sort(placed), np.flatnonzero(real.reshape(-1)))
  for b in range(16):
    r, c = np.nonzero(plan.segment_ids == b + 1)
    assert len(set(r)) == 1  # a sequence stays in one row ...
    np.testing.assert_array_equal(c, np.arange(c[0], c[0] + len(c)))  # ... contiguous
    np.testing.assert_array_equal(plan.positions[r, c], np.arange(len(c)))
    np.testing.assert_array_equal(tokens.reshape(-1)[plan.source[r, c]], tokens[b][real[b]])
    assert (plan.last_rows[b], plan.last_cols[b]) == (r[-1], c[-1])
    # The column before completion token t holds the token that precedes it.
    n = completion_mask[b].sum()
    prompt_count = prompt_mask[b].sum()
    gathered = plan.source[plan.completion_rows[b, :n], plan.completion_cols[b, :n]]
    np.testing.assert_array_equal(gathered, b * (PROMPT + COMPLETION) + PROMPT - 1
                                  + np.arange(n))
    assert plan.segment_ids[plan.completion_rows[b, :n], plan.completion_cols[b, :n]].tolist() \
        == [b + 1] * n and prompt_count >= 1
  # The model's own positions for these segments are the plan's.
  got = np.asarray(segment_positions(jnp.asarray(plan.segment_ids)))
  np.testing.assert_array_equal(np.where(plan.segment_ids != 0, got, 0), plan.positions)
  if budget == 40:
    assert rows < 16 and packing.occupancy(plan) > 0.5
  # The LM head's entries: one per real completion token, the state just before it,
  # counted up to one of round_rows' sizes.
  count = int(completion_mask.sum())
  assert plan.head_index.shape == plan.head_targets.shape == (
      packing.round_rows(count, row_multiple),)
  b, t = np.nonzero(completion_mask)
  slot = plan.completion_slot[b, t]
  np.testing.assert_array_equal(np.sort(slot), np.arange(count))
  np.testing.assert_array_equal(plan.head_index[slot],
                                plan.completion_rows[b, t] * budget + plan.completion_cols[b, t])
  np.testing.assert_array_equal(plan.head_targets[slot], b * COMPLETION + t)


def test_row_counts_come_in_few_shapes():
  assert [packing.round_rows(n) for n in (1, 3, 4, 7, 8, 9, 11, 17, 33, 64, 65)] == [
      1, 3, 4, 7, 8, 10, 12, 20, 40, 64, 80]
  assert packing.round_rows(9, 8) == 16 and packing.round_rows(5, 2) == 6
  # 1, 2, 3, four an octave from 4 to 255, and 256.
  assert len({packing.round_rows(n) for n in range(1, 257)}) == 3 + 4 * 6 + 1


def test_a_sequence_longer_than_a_row_is_refused_naming_the_setting():
  _, prompt_mask, _, completion_mask = padded_batch()
  with pytest.raises(ValueError, match=r"stages.infer.pack_tokens=12: sequence \d+ has 1[3-6] "
                                       r"real tokens .*at least 1[3-6] .*P \+ T = 16"):
    packing.plan_packing(prompt_mask, completion_mask, 12)
  right_padded_prompt = prompt_mask[:, ::-1]
  with pytest.raises(ValueError, match="left-padded prompt"):
    packing.plan_packing(right_padded_prompt, completion_mask, 16)


def _models(**overrides):
  config = tiny_config(vocab_size=VOCAB, embed_dim=32, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp_dim=64, dtype="float32", **overrides)
  return [nnx.split(init_model(config.replace(head=head), seed=seed))
          for seed, head in enumerate(("lm", "value", "score"))]


_EXECUTIONS = {
    "dense": dict(attention="dense"),
    "blockwise": dict(attention="blockwise", attention_block_size=4, logits_chunk_size=3),
    "sliding_window": dict(attention="dense", sliding_window=3,
                           layer_types=("sliding_attention", "full_attention")),
}


# Each execution and each budget once in the default run; the other three pairs in the
# slow tier.
@pytest.mark.parametrize("execution,budget", [
    pytest.param(execution, budget, id=f"{budget}-{name}",
                 marks=[] if (name == "dense") == (budget == PROMPT + COMPLETION)
                 else [pytest.mark.slow])
    for name, execution in _EXECUTIONS.items() for budget in (PROMPT + COMPLETION, 24)])
def test_packed_forwards_equal_the_padded_ones(execution, budget):
  (policy, policy_p), (critic, critic_p), (reward, reward_p) = _models(**execution)
  prompt_tokens, prompt_mask, completion_tokens, completion_mask = map(
      jnp.asarray, padded_batch(seed=1))
  args = (prompt_tokens, prompt_mask, completion_tokens, completion_mask)
  plan = jax.tree.map(jnp.asarray,
                      packing.plan_packing(prompt_mask, completion_mask, budget))
  packed_args = (plan, prompt_tokens, completion_tokens)

  want = jax.jit(lambda p: completion_logprobs(policy, p, *args, temperature=0.7))(policy_p)
  got = jax.jit(lambda p: packed_completion_logprobs(policy, p, *packed_args,
                                                     completion_mask, temperature=0.7)
                )(policy_p)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(got)[~np.asarray(completion_mask)] == 0)

  want = completion_values(critic, critic_p, *args)
  got = packed_completion_values(critic, critic_p, *packed_args, completion_mask)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(got)[~np.asarray(completion_mask)] == 0)

  want = sequence_scores(reward, reward_p, *args)
  got = packed_sequence_scores(reward, reward_p, *packed_args)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_packed_inference_changes_how_not_what(tmp_path):
  # The same two PPO steps, the inference stage padded and packed into rows of 16 tokens
  # (8 prompt + 4 completion columns a sequence: several sequences share a row).
  results = []
  for plan in (StagePlan(), StagePlan(pack_tokens=16)):
    system, tok = _tiny_system(tmp_path, infer=plan)
    plans = []
    pack = system.infer_stage.pack
    system.infer_stage.pack = lambda rollout: plans.append(pack(rollout)) or plans[-1]
    prompts = prompts_from_texts([f"rev {w}=" for w in "abcdefgh"], tok, 8, 8)
    results.append(run(system, prompts, steps=2).metrics)
    # Packed into rows of 16 columns, as many rows as the 8 ways the batch is split.
    assert [p.source.shape for p in plans] == ([(8, 16)] * 2 if plan.pack_tokens else [])
  for want, got in zip(*results):
    for key in ("reward/mean", "kl/mean", "value/mean", "policy_loss", "value_loss"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_pack_tokens_is_an_inference_and_training_setting():
  assert StagePlan.from_config({"pack_tokens": 512}, "stages.infer").pack_tokens == 512
  with pytest.raises(ValueError, match="stages.infer.pack_tokens=-1"):
    StagePlan.from_config({"pack_tokens": -1}, "stages.infer")
  from pipe_rlhf_jax.config import Plan
  with pytest.raises(ValueError, match="stages.generate.pack_tokens=64: generation decodes, "
                                       "it does not pack; set stages.infer.pack_tokens or "
                                       "stages.train.pack_tokens"):
    Plan(generate=StagePlan(pack_tokens=64))


@pytest.mark.parametrize("spare_columns", [0, 30])
def test_packed_logprobs_and_entropy_equal_the_padded_ones(spare_columns):
  # The head runs on the real completion tokens' states only, fewer than the padded
  # layout's [batch, T] positions (with T padded far past the completions or not) and
  # than the packed columns; chunked, the last chunk partly spare.
  (policy, policy_p), _, _ = _models(logits_chunk_size=3)
  prompt_tokens, prompt_mask, completion_tokens, completion_mask = padded_batch(seed=3)
  completion_tokens = np.pad(completion_tokens, ((0, 0), (0, spare_columns)))
  completion_mask = np.pad(completion_mask, ((0, 0), (0, spare_columns)))
  plan = packing.plan_packing(prompt_mask, completion_mask, PROMPT + COMPLETION)
  assert plan.head_index.size < min(completion_mask.size, plan.source.size)
  args = tuple(map(jnp.asarray, (prompt_tokens, prompt_mask, completion_tokens,
                                 completion_mask)))
  want = completion_logprobs(policy, policy_p, *args, temperature=0.7, return_entropy=True)
  got = packed_completion_logprobs(policy, policy_p, jax.tree.map(jnp.asarray, plan),
                                   args[0], args[2], args[3], temperature=0.7,
                                   return_entropy=True)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
