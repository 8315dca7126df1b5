"""Preference pairs from the SFT policy's own samples (phases.policy_pairs): rows are the
best and the worst of k samples by the label rule, ties keep the dataset pair, the
pairs are reproducible, and the warm start trains its reward model on them."""

from flax import nnx
import numpy as np
import pytest

from pipe_rlhf_jax.config import ExperimentSettings
from pipe_rlhf_jax.generation.sampler import SamplingSettings
from pipe_rlhf_jax.models.config import tiny_config
from pipe_rlhf_jax.models.tokenizer import load_tokenizer
from pipe_rlhf_jax.models.transformer import init_model
from pipe_rlhf_jax.phases import supervised
from pipe_rlhf_jax.phases.policy_pairs import PolicyPairs
from pipe_rlhf_jax.phases.warm_start import warm_start_fingerprint
from pipe_rlhf_jax.train import prepare_warm_start, train
from tests.helpers.configs import tiny_quickstart

TOKENIZER = load_tokenizer("byte")
B, P, T = 8, 10, 5


def dataset_batches():
  """Endless copies of one preference batch whose pairs are recognisable (all 7s/8s)."""
  prompt = np.zeros((B, P), np.int32)
  mask = np.zeros((B, P), bool)
  for row, word in enumerate(["abc", "bad", "cab", "dga", "hgf", "fed", "ace", "bdf"]):
    ids = TOKENIZER.encode(f"rev {word}=")
    prompt[row, P - len(ids):], mask[row, P - len(ids):] = ids, True
  batch = {"prompt_tokens": prompt, "prompt_mask": mask,
           "chosen_tokens": np.full((B, T), 7, np.int32), "chosen_mask": np.ones((B, T), bool),
           "rejected_tokens": np.full((B, T), 8, np.int32),
           "rejected_mask": np.ones((B, T), bool), "index": np.arange(B)}
  while True:
    yield {k: v.copy() for k, v in batch.items()}


def char_sum(prompts, completions):
  """A label that a random model's samples rarely tie on."""
  return np.asarray([sum(map(ord, c)) for c in completions], np.float32)


def pairs(label_fn=char_sum, share=0.5, k=4):
  policy = init_model(tiny_config(embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                  head_dim=8, mlp_dim=64), seed=0)
  graphdef, params = nnx.split(policy)
  sampling = SamplingSettings(max_new_tokens=T, temperature=1.0, eos_id=TOKENIZER.eos_id,
                            pad_id=TOKENIZER.pad_id)
  return PolicyPairs(dataset_batches(), graphdef, params, TOKENIZER, label_fn, share=share,
                     samples_per_prompt=k, sampling=sampling, seed=3)


def decoded(tokens, mask):
  return [TOKENIZER.decode(t[m]) for t, m in zip(tokens, mask)]


def test_replaced_rows_are_the_best_and_worst_sample_and_the_rest_are_kept():
  it = pairs()
  batches = [next(it) for _ in range(3)]
  replaced = 0
  for batch in batches:
    chosen = decoded(batch["chosen_tokens"], batch["chosen_mask"])
    rejected = decoded(batch["rejected_tokens"], batch["rejected_mask"])
    for row in range(B):
      dataset_pair = (batch["chosen_tokens"][row] == 7).all()
      if row >= B // 2 or dataset_pair:  # outside the share, or its samples all tied
        assert dataset_pair and (batch["rejected_tokens"][row] == 8).all()
        continue
      replaced += 1
      assert char_sum(None, [chosen[row]]) > char_sum(None, [rejected[row]])
      # The sampler's completion layout: right-padded, mask True through EOS.
      m = batch["chosen_mask"][row]
      assert not (np.diff(m.astype(int)) > 0).any()
    for key in ("prompt_tokens", "prompt_mask", "index"):
      np.testing.assert_array_equal(batch[key], next(dataset_batches())[key])
  summary = it.summary()
  assert summary["policy_pairs"] == replaced > 0
  assert summary["policy_pairs"] + summary["policy_pairs_tied"] == 3 * B // 2
  assert summary["policy_chosen_label"] > summary["policy_rejected_label"]
  # Keyed by step and row: a second iterator gives the same pairs.
  again = pairs()
  for batch in batches:
    other = next(again)
    for key in batch:
      np.testing.assert_array_equal(batch[key], other[key])


def test_ties_keep_the_dataset_pair_and_share_zero_changes_nothing():
  it = pairs(label_fn=lambda p, c: np.zeros(len(c), np.float32))
  batch = next(it)
  assert (batch["chosen_tokens"] == 7).all() and (batch["rejected_tokens"] == 8).all()
  assert it.summary()["policy_pairs"] == 0 and it.summary()["policy_pairs_tied"] == B // 2
  batch = next(pairs(share=0.0))
  assert (batch["chosen_tokens"] == 7).all()
  with pytest.raises(ValueError, match="policy_samples=1: a pair needs at least 2"):
    pairs(k=1)


def test_warm_start_trains_the_reward_model_on_policy_pairs(tmp_path, monkeypatch):
  seen = []
  real_fit = supervised.fit

  def recording_fit(loss_fn, params, layout, batches, **kw):
    if kw["phase"] == "reward_model":
      seen.append(type(batches).__name__)
    return real_fit(loss_fn, params, layout, batches, **kw)

  monkeypatch.setattr(supervised, "fit", recording_fit)
  config = tiny_quickstart("sequential", {"reward_model.policy_pairs": 0.5})
  result = prepare_warm_start(config, str(tmp_path / "run"), progress=False)
  assert seen == ["PolicyPairs"]
  rm_eval = result["rm_eval"]
  # 4 steps x 8 of 16 rows, minus the rows whose 4 samples all tied.
  assert rm_eval["policy_pairs"] + rm_eval["policy_pairs_tied"] == 4 * 8
  assert rm_eval["policy_chosen_label"] >= rm_eval["policy_rejected_label"]
  # Off, the settings leave the fingerprint as it was before they existed.
  off = tiny_quickstart("sequential")
  before = tiny_quickstart("sequential")
  for key in ("policy_pairs", "policy_samples", "label_fn"):
    del before.reward_model[key]
  fingerprint = lambda c: warm_start_fingerprint(ExperimentSettings.from_config(c))
  assert fingerprint(off) == fingerprint(before)
  assert fingerprint(config) != fingerprint(off)


@pytest.mark.parametrize("overrides, match", [
    ({"reward_model.policy_pairs": 1.5}, r"reward_model.policy_pairs=1.5 must be a fraction"),
    ({"reward_model.policy_pairs": 0.5, "reward_model.policy_samples": 1},
     r"reward_model.policy_samples=1: a pair is the best and the worst"),
    ({"reward_model.policy_pairs": 0.5, "reward_model.label_fn": "nope"},
     r"Unknown reward function 'nope' \(config field reward_model.label_fn\)"),
    ({"reward_model.policy_pairs": 0.5, "reward.eval_fn": ""},
     r"reward_model.policy_pairs needs a rule to rank the samples"),
])
def test_bad_policy_pair_settings_name_the_field(tmp_path, overrides, match):
  with pytest.raises(ValueError, match=match):
    train(tiny_quickstart("sequential", overrides), str(tmp_path), progress=False)
  assert not (tmp_path / "data").exists()
