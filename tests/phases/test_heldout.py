"""phases/heldout.py: held-out answers (greedy and sampled), the paired change of
per-prompt scores and its summary line."""

import numpy as np
import pytest

from pipe_rlhf_jax.phases import heldout


def test_paired_change_counts_prompts_and_bounds_the_mean_change():
  change = heldout.paired_change([1.0, 1.0, 0.0, 0.5], [1.0, 0.0, 1.0, 0.5])
  assert (change.delta, change.worse, change.better) == (0.0, 1, 1)
  assert change.low < 0.0 < change.high and not change.significantly_worse
  same = heldout.paired_change([0.25] * 8, [0.25] * 8)
  assert (same.delta, same.low, same.high, same.worse, same.better) == (0, 0, 0, 0, 0)
  # Half the prompts fell by 0.5 and none rose: every resample of the prompts falls.
  drop = heldout.paired_change([1.0] * 32, [0.5] * 16 + [1.0] * 16)
  assert drop.delta == -0.25 and drop.high < 0 and drop.significantly_worse
  assert -0.5 <= drop.low <= drop.high
  # The interval is reproducible (a fixed seed), and its seed is a parameter.
  assert heldout.paired_change([1.0] * 32, [0.5] * 16 + [1.0] * 16) == drop


def test_paired_change_refuses_unpaired_scores():
  with pytest.raises(ValueError, match="equally long"):
    heldout.paired_change([1.0, 0.0], [1.0])
  with pytest.raises(ValueError, match="non-empty"):
    heldout.paired_change([], [])


def test_summary_line_states_the_change_and_its_interval():
  before = heldout.HeldoutEval([], {"rule": 0.75}, 4, {"rule": [1.0, 1.0, 0.0, 1.0]})
  after = heldout.HeldoutEval([], {"rule": 0.5}, 4, {"rule": [1.0, 0.0, 0.0, 1.0]})
  line = heldout.summary_lines(before, after)["held-out greedy rule"]
  assert line.startswith("0.750 -> 0.500 (4 prompts; change -0.250, 95% interval [")
  assert line.endswith("1 worse / 0 better)")
  # Scores without per-prompt values (another caller's) keep the short line.
  short = heldout.summary_lines(heldout.HeldoutEval([], {"rule": 0.75}, 4),
                                heldout.HeldoutEval([], {"rule": 0.5}, 4))
  assert short == {"held-out greedy rule": "0.750 -> 0.500 (4 prompts)"}
  assert np.mean(before.per_prompt["rule"]) == before.scores["rule"]
  sampled = heldout.HeldoutEval([], {"rule": 0.5}, 4, {"rule": [0.5] * 4}, 8)
  assert list(heldout.summary_lines(sampled, sampled)) == [
      "held-out sampled (8 per prompt) rule"]


def policy_and_prompts():
  """A random tiny policy and 6 left-padded prompts (a batch as the eval pipeline makes)."""
  from flax import nnx

  from pipe_rlhf_jax.models.config import tiny_config
  from pipe_rlhf_jax.models.tokenizer import load_tokenizer
  from pipe_rlhf_jax.models.transformer import init_model
  tokenizer = load_tokenizer("byte")
  policy = init_model(tiny_config(embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                  head_dim=8, mlp_dim=64), seed=0)
  words = ["abc", "bad", "cabd", "dga", "hgfe", "fed"]
  length = 10
  tokens, mask = np.zeros((6, length), np.int32), np.zeros((6, length), bool)
  for row, word in enumerate(words):
    ids = tokenizer.encode(f"rev {word}=", add_bos=True)
    tokens[row, length - len(ids):], mask[row, length - len(ids):] = ids, True
  return nnx.split(policy), {"prompt_tokens": tokens, "prompt_mask": mask}, tokenizer


def first_letter_a(prompts, completions):
  """A rule a random model's samples score on differently: 1 if it starts with 'a'."""
  return np.asarray([float(c[:1] == "a") + 0.01 * len(c) for c in completions], np.float32)


def test_sampled_eval_averages_k_draws_per_prompt_whatever_the_layout():
  import jax

  from pipe_rlhf_jax.generation.sampler import SamplingSettings
  (graphdef, params), batch, tokenizer = policy_and_prompts()
  sampling = SamplingSettings(max_new_tokens=6, temperature=1.0, eos_id=tokenizer.eos_id,
                            pad_id=tokenizer.pad_id)
  rules = {"rule": first_letter_a}
  sampled = heldout.heldout_eval(graphdef, params, batch, tokenizer, sampling, rules, 2,
                                 samples_per_prompt=3)
  assert sampled.num_prompts == 6 and len(sampled.per_prompt["rule"]) == 6
  assert sampled.samples_per_prompt == 3 and sampled.decoding == "sampled (3 per prompt)"
  assert len(sampled.samples) == 2 and sampled.samples[0].startswith("'rev abc=' -> ")
  assert sampled.scores["rule"] == pytest.approx(np.mean(sampled.per_prompt["rule"]))
  # Reproducible, and keyed by sample: the same draws with the weights replicated over
  # 8 devices as on one (a run evaluates on its generation layout, a rescore on another).
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
  replicated = jax.device_put(params, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()))
  again = heldout.heldout_eval(graphdef, replicated, batch, tokenizer, sampling, rules, 2,
                               samples_per_prompt=3)
  assert again.per_prompt == sampled.per_prompt and again.samples == sampled.samples
  # Greedy: one answer per prompt, the first of the sampled prompts' order.
  greedy = heldout.heldout_eval(graphdef, params, batch, tokenizer, sampling, rules, 6)
  assert greedy.decoding == "greedy" and greedy.num_prompts == 6
  assert [line.split(" -> ")[0] for line in greedy.samples] == [
      "'rev abc='", "'rev bad='", "'rev cabd='", "'rev dga='", "'rev hgfe='", "'rev fed='"]

