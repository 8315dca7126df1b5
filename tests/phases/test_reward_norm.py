"""phases/reward_norm.py: the reward model's score statistics under the warm-start policy."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipe_rlhf_jax.generation.sampler import SamplingSettings, generate
from pipe_rlhf_jax.models.config import tiny_config
from pipe_rlhf_jax.models.transformer import init_model
from pipe_rlhf_jax.phases import reward_norm
from pipe_rlhf_jax.stages.common import sequence_scores
from tests.phases.test_heldout import policy_and_prompts


def test_reward_score_statistics_are_the_scores_of_the_policy_answers():
  (graphdef, params), batch, tokenizer = policy_and_prompts()
  reward_gd, reward = nnx.split(init_model(tiny_config(
      embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
      head="score"), seed=1))
  sampling = SamplingSettings(max_new_tokens=6, temperature=1.0, eos_id=tokenizer.eos_id,
                            pad_id=tokenizer.pad_id)
  stats = reward_norm.score_statistics(graphdef, params, reward_gd, reward, batch, sampling,
                                       samples_per_prompt=3, seed=5)
  # The same answers drawn directly (3 per prompt, keyed by sample), scored directly.
  tokens = np.repeat(batch["prompt_tokens"], 3, axis=0)
  mask = np.repeat(batch["prompt_mask"], 3, axis=0)
  out = generate(nnx.merge(graphdef, params), tokens, mask, 6, rng=jax.random.key(5),
                 temperature=1.0, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                 sample_ids=np.arange(18, dtype=np.int32))
  scores = np.asarray(sequence_scores(reward_gd, reward, tokens, mask, out.tokens, out.mask))
  assert stats.samples == 18
  assert stats.mean == pytest.approx(scores.mean(), abs=1e-6)
  assert stats.std == pytest.approx(scores.std(), rel=1e-5) and stats.std > 0
  # A reward model that scores every answer alike cannot be standardised: said by name.
  flat = jax.tree.map(jnp.zeros_like, reward)
  with pytest.raises(ValueError, match="reward.normalize_samples_per_prompt: the reward "
                                       "model gave all 18 answers"):
    reward_norm.score_statistics(graphdef, params, reward_gd, flat, batch, sampling,
                                 samples_per_prompt=3, seed=5)

