"""Tests for data/arith.py (the arith task generator), its rule rewards and datasets."""

import json
import re

import numpy as np
import pytest

from pipe_rlhf_jax.data import rewards
from pipe_rlhf_jax.data.arith import (
  ArithSettings,
  main,
  make_arith_records,
  make_prompt,
  solve,
  write_arith_jsonl,
)
from pipe_rlhf_jax.data.builders import make_arith_datasets
from pipe_rlhf_jax.ppo.registry import REWARD_FUNCTIONS

_PROBLEM = re.compile(r"^(\d+)([-+*])(\d+)=$")


def _records(seed=0, spec=ArithSettings(), **kw):
  args = dict(num_prompts=300, num_demos=2000, num_eval=100)
  args.update(kw)
  return make_arith_records(seed=seed, spec=spec, **args)


def _parse(prompt):
  m = _PROBLEM.match(prompt)
  assert m, prompt
  return int(m.group(1)), m.group(2), int(m.group(3))


def test_same_seed_same_records_other_seed_differs():
  a, b, c = _records(0), _records(0), _records(1)
  assert a == b
  assert a["prompts"] != c["prompts"] and a["demos"] != c["demos"]
  assert a["prompts_eval"] != c["prompts_eval"]


def test_record_kinds_use_independent_streams():
  a = _records(0)
  b = _records(0, num_demos=10)
  assert a["prompts"] == b["prompts"] and a["prompts_eval"] == b["prompts_eval"]
  assert b["demos"] == a["demos"][:10]


def test_solve_and_prompt_by_hand():
  assert make_prompt(12, "+", 57) == "12+57="
  assert [solve(12, "+", 57), solve(3, "-", 17), solve(7, "*", 86), solve(0, "*", 9)] == [
      "69", "-14", "602", "0"]
  with pytest.raises(ValueError, match="operator"):
    solve(1, "/", 2)


def test_clean_demos_are_right_and_operands_in_range():
  spec = ArithSettings(operators="+-*", min_digits=2, max_digits=3, demo_noise=0.0)
  recs = _records(4, spec)
  ops, sizes = set(), set()
  for r in recs["demos"]:
    a, op, b = _parse(r["prompt"])
    # Python's own arithmetic, not the generator's table.
    assert r["completion"] == str(eval(f"{a}{op}{b}")), r  # noqa: S307 (digits only)
    ops.add(op)
    sizes |= {len(str(a)), len(str(b))}
  assert ops == {"+", "-", "*"} and sizes == {2, 3}
  assert any(r["completion"].startswith("-") for r in recs["demos"])
  one_digit = _records(4, ArithSettings(min_digits=1, max_digits=1), num_eval=10)
  operands = {x for r in one_digit["prompts"] for x in _parse(r["prompt"])[::2]}
  assert operands == set(range(10))  # 0..9, zero included


def test_demo_noise_rate_and_only_digits_change():
  spec = ArithSettings(operators="+-", max_digits=2, demo_noise=0.3)
  recs = _records(5, spec)
  errors = total = 0
  for r in recs["demos"]:
    target = rewards.arith_target(r["prompt"])
    assert len(r["completion"]) == len(target)
    assert r["completion"].startswith("-") == target.startswith("-")  # signs untouched
    digits = [(t, c) for t, c in zip(target, r["completion"]) if t != "-"]
    assert all(c.isdigit() for _, c in digits)
    errors += sum(t != c for t, c in digits)
    total += len(digits)
  assert 0.27 < errors / total < 0.33, errors / total


def test_eval_problems_distinct_and_held_out():
  recs = _records(3, ArithSettings(max_digits=1), num_prompts=500, num_demos=500, num_eval=40)
  eval_prompts = [r["prompt"] for r in recs["prompts_eval"]]
  assert len(set(eval_prompts)) == 40
  train = {r["prompt"] for r in recs["prompts"] + recs["demos"]}
  assert not set(eval_prompts) & train
  assert len(train) > 40  # 100 problems, 40 held out: the rest all drawn


def test_bad_settings_name_the_field():
  with pytest.raises(ValueError, match=r"arith.operators='/'"):
    ArithSettings(operators="/")
  with pytest.raises(ValueError, match=r"arith.operators='\+\+'"):
    ArithSettings(operators="++")
  with pytest.raises(ValueError, match=r"data.arith.max_digits=1 must be an integer >= 2"):
    ArithSettings.from_config(dict(min_digits=2, max_digits=1))
  with pytest.raises(ValueError, match=r"data.arith.demo_noise=1.5"):
    ArithSettings.from_config(dict(demo_noise=1.5))
  with pytest.raises(ValueError, match=r"data.arith has unknown fields \['digits'\]"):
    ArithSettings.from_config(dict(digits=2))
  with pytest.raises(ValueError, match="num_eval=51 is too large for 100"):
    make_arith_records(1, 1, 0, ArithSettings(max_digits=1), num_eval=51)


def test_write_jsonl_and_cli(tmp_path):
  spec = ArithSettings(operators="+-", demo_noise=0.2)
  paths = write_arith_jsonl(str(tmp_path / "a"), 20, 10, seed=2, spec=spec, num_eval=4)
  lines = {k: [json.loads(line) for line in open(p, encoding="utf-8")] for k, p in paths.items()}
  assert lines == make_arith_records(20, 10, 2, spec, num_eval=4)
  main(["--out_dir", str(tmp_path / "b"), "--num_prompts", "20", "--num_demos", "10",
        "--num_eval", "4", "--seed", "2", "--operators", "+-", "--demo_noise", "0.2"])
  for name in ("prompts.jsonl", "demos.jsonl", "prompts_eval.jsonl", "task_config.json"):
    assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_make_arith_datasets(tmp_path):
  data_dir = str(tmp_path / "tfds")
  spec = ArithSettings(operators="+*")
  out = make_arith_datasets(data_dir, seed=3, spec=spec, num_prompts=64, num_demos=48,
                            num_eval=16)
  assert set(out) == {"data_dir", "jsonl", "prompts", "demos"}  # no preference pairs
  assert out["prompts"].name == "arith_prompts"
  assert out["prompts"].splits == {"train": 64, "eval": 16}
  expected = make_arith_records(64, 48, 3, spec, num_eval=16)
  demos = out["demos"].source("train")
  assert [{"prompt": demos[i]["prompt"].decode(), "completion": demos[i]["completion"].decode()}
          for i in range(len(demos))] == expected["demos"]
  # Another spec regenerates the JSONL and rebuilds the datasets.
  changed = make_arith_datasets(data_dir, seed=3, spec=ArithSettings(operators="-"),
                                num_prompts=64, num_demos=48, num_eval=16)
  assert changed["prompts"].fingerprint != out["prompts"].fingerprint
  assert "-" in changed["prompts"].source("train")[0]["prompt"].decode()


def test_rewards_registered_and_scores_by_hand():
  exact = REWARD_FUNCTIONS.get("arith_exact_match")
  digits = REWARD_FUNCTIONS.get("arith_digit_accuracy")
  prompts = ["12+57="] * 7 + ["3-17=", "7*86="]
  completions = ["69", " 69\n", "68", "9", "169", "069", "", "-14", "612"]
  e = exact(prompts, completions)
  d = digits(prompts, completions)
  assert e.dtype == np.float32 and e.shape == (9,) and d.dtype == np.float32
  np.testing.assert_array_equal(e, [1, 1, 0, 0, 0, 0, 0, 1, 0])
  # Right-aligned positions over the longer length: "68" 1/2, "9" 1/2, "169" and "069" 2/3,
  # "612" vs "602" 2/3.
  np.testing.assert_allclose(d, [1, 1, 0.5, 0.5, 2 / 3, 2 / 3, 0, 1, 2 / 3], rtol=0, atol=1e-7)
  # The last problem in a longer prompt is the one asked.
  assert rewards.arith_target("Q: 1+1= 2. Q: 40*3=") == "120"


def test_rewards_refuse_other_prompts():
  for fn in (rewards.arith_exact_match, rewards.arith_digit_accuracy):
    with pytest.raises(ValueError, match=r"not an arith-task prompt.*data.task='arith'"):
      fn(["rev abcd="], ["dcba"])
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
      fn(["1+1=", "2+2="], ["2"])


def test_rewards_rank_noise_below_correct():
  recs = _records(11, ArithSettings(demo_noise=0.5))
  prompts = [r["prompt"] for r in recs["demos"]]
  noisy = [r["completion"] for r in recs["demos"]]
  correct = [rewards.arith_target(p) for p in prompts]
  assert rewards.arith_exact_match(prompts, correct).min() == 1.0
  assert rewards.arith_exact_match(prompts, noisy).mean() < 0.4
  assert 0.4 < rewards.arith_digit_accuracy(prompts, noisy).mean() < 0.6
