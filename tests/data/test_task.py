"""Tests for data/task.py (the reverse task generator) and data/rewards.py."""

import json
import re

import numpy as np
import pytest

from pipe_rlhf_jax.data import rewards
from pipe_rlhf_jax.data.task import main, make_task_records, write_task_jsonl
from pipe_rlhf_jax.ppo.registry import REWARD_FUNCTIONS

_PROMPT = re.compile(r"^rev ([a-h]{3,6})=$")


def _records(seed=0, **kw):
  args = dict(num_prompts=300, num_demos=2000, num_pairs=500, seed=seed, num_eval=100)
  args.update(kw)
  return make_task_records(**args)


def test_same_seed_same_records_other_seed_differs():
  a, b, c = _records(0), _records(0), _records(1)
  assert a == b
  assert a["prompts"] != c["prompts"] and a["demos"] != c["demos"] and a["prefs"] != c["prefs"]


def test_record_kinds_use_independent_streams():
  a = _records(0)
  b = _records(0, num_demos=10, num_pairs=7)
  assert a["prompts"] == b["prompts"] and a["prompts_eval"] == b["prompts_eval"]
  assert b["demos"] == a["demos"][:10]


def test_record_format_and_eval_disjoint():
  recs = _records(3)
  assert [len(recs[k]) for k in ("prompts", "demos", "prefs", "prompts_eval", "prefs_eval")] == [
      300, 2000, 500, 100, 100]
  train = set()
  for kind in ("prompts", "demos", "prefs"):
    for r in recs[kind]:
      m = _PROMPT.match(r["prompt"])
      assert m, r
      train.add(m.group(1))
  eval_letters = {_PROMPT.match(r["prompt"]).group(1) for r in recs["prompts_eval"]}
  assert len(eval_letters) == 100  # distinct
  assert not eval_letters & train
  assert {r["prompt"] for r in recs["prefs_eval"]} <= {r["prompt"] for r in recs["prompts_eval"]}
  lengths = {len(m) for m in train}
  assert lengths == {3, 4, 5, 6}


def test_demo_noise_rate():
  recs = _records(5, demo_noise=0.3)
  errors = total = 0
  for r in recs["demos"]:
    target = rewards.reverse_target(r["prompt"])
    assert len(r["completion"]) == len(target)
    errors += sum(a != b for a, b in zip(target, r["completion"]))
    total += len(target)
  assert 0.27 < errors / total < 0.33
  clean = _records(5, demo_noise=0.0)["demos"]
  assert all(r["completion"] == rewards.reverse_target(r["prompt"]) for r in clean)


def test_chosen_is_strictly_better_and_lengths_vary():
  recs = _records(7)
  pairs = recs["prefs"] + recs["prefs_eval"]
  prompts = [p["prompt"] for p in pairs]
  chosen = rewards.reverse_accuracy(prompts, [p["chosen"] for p in pairs])
  rejected = rewards.reverse_accuracy(prompts, [p["rejected"] for p in pairs])
  assert np.all(chosen > rejected)
  length_errors = np.mean([len(p["rejected"]) != len(p["chosen"]) for p in pairs])
  assert 0.1 < length_errors < 0.3  # length_noise=0.2


def test_bad_arguments_are_rejected():
  with pytest.raises(ValueError, match="alphabet"):
    make_task_records(1, 1, 1, 0, alphabet="a")
  with pytest.raises(ValueError, match="min_len"):
    make_task_records(1, 1, 1, 0, min_len=4, max_len=3)
  with pytest.raises(ValueError, match="demo_noise"):
    make_task_records(1, 1, 1, 0, demo_noise=1.5)
  with pytest.raises(ValueError, match="num_eval"):
    make_task_records(1, 1, 1, 0, alphabet="ab", min_len=1, max_len=1, num_eval=2)


def test_write_jsonl_and_cli(tmp_path):
  paths = write_task_jsonl(str(tmp_path / "a"), 20, 10, 5, seed=2, num_eval=4)
  lines = {k: [json.loads(line) for line in open(p, encoding="utf-8")] for k, p in paths.items()}
  expected = make_task_records(20, 10, 5, 2, num_eval=4)
  assert lines == expected
  main(["--out_dir", str(tmp_path / "b"), "--num_prompts", "20", "--num_demos", "10",
        "--num_pairs", "5", "--num_eval", "4", "--seed", "2"])
  for name in ("prompts.jsonl", "demos.jsonl", "prefs.jsonl", "prefs_eval.jsonl",
               "prompts_eval.jsonl"):
    assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_rewards_registered_and_scores():
  acc = REWARD_FUNCTIONS.get("reverse_accuracy")
  exact = REWARD_FUNCTIONS.get("reverse_exact")
  prompts = ["rev abcd="] * 7
  completions = ["dcba", " dcba\n", "dcbb", "dcb", "dcbax", "zzzz", ""]
  a = acc(prompts, completions)
  e = exact(prompts, completions)
  assert a.dtype == np.float32 and a.shape == (7,)
  np.testing.assert_allclose(a, [1.0, 1.0, 0.75, 0.75, 0.8, 0.0, 0.0], rtol=0, atol=1e-7)
  np.testing.assert_array_equal(e, [1, 1, 0, 0, 0, 0, 0])
  assert e.dtype == np.float32


def test_rewards_rank_noise_below_correct():
  recs = _records(11, demo_noise=0.5)
  prompts = [r["prompt"] for r in recs["demos"]]
  correct = [rewards.reverse_target(p) for p in prompts]
  noisy = [r["completion"] for r in recs["demos"]]
  assert rewards.reverse_accuracy(prompts, correct).min() == 1.0
  assert rewards.reverse_accuracy(prompts, noisy).mean() < 0.6
  assert rewards.reverse_exact(prompts, noisy).mean() < 0.2


def test_rewards_reject_bad_input():
  with pytest.raises(ValueError, match="reverse-task prompt"):
    rewards.reverse_accuracy(["hello"], ["olleh"])
  with pytest.raises(ValueError, match="completions"):
    rewards.reverse_exact(["rev ab="], ["ba", "ba"])


def test_hard_pairs_differ_by_one_neighbour_copy():
  recs = _records(13, hard_pairs=1.0)
  pairs = recs["prefs"] + recs["prefs_eval"]
  prompts = [p["prompt"] for p in pairs]
  answers = [rewards.reverse_target(p) for p in prompts]
  copies = 0
  for pair, answer in zip(pairs, answers):
    chosen, rejected = pair["chosen"], pair["rejected"]
    assert len(chosen) == len(rejected) == len(answer)
    diff = [i for i in range(len(answer)) if chosen[i] != rejected[i]]
    assert len(diff) == 1 and chosen[diff[0]] == answer[diff[0]]  # one more error
    i = diff[0]
    copies += rejected[i] in {rejected[j] for j in (i - 1, i + 1) if 0 <= j < len(answer)}
  # Only answers whose every neighbour holds the right letter fall back to a random letter.
  assert copies / len(pairs) > 0.8
  chosen_acc = rewards.reverse_accuracy(prompts, [p["chosen"] for p in pairs])
  rejected_acc = rewards.reverse_accuracy(prompts, [p["rejected"] for p in pairs])
  assert np.all(chosen_acc > rejected_acc)


def test_hard_pairs_off_keeps_the_records_and_mixes_when_on():
  assert _records(2, hard_pairs=0.0) == _records(2)
  mixed = _records(2, hard_pairs=0.5)
  assert mixed["prompts"] == _records(2)["prompts"]  # only the pairs' stream changes
  one_diff = np.mean([sum(a != b for a, b in zip(p["chosen"], p["rejected"])) == 1
                      and len(p["chosen"]) == len(p["rejected"]) for p in mixed["prefs"]])
  assert 0.5 < one_diff < 0.75  # half hard, plus the random pairs one error apart
  with pytest.raises(ValueError, match="hard_pairs"):
    make_task_records(1, 1, 1, 0, hard_pairs=2.0)
