"""Tests for data/word_problems.py (the chat word-problem generator), its settings and
datasets, and that the `math_verify` rule scores its answers."""

import json
import re

import pytest

from pipe_rlhf_jax.config.experiment import DataSettings
from pipe_rlhf_jax.data import math_reward
from pipe_rlhf_jax.data.builders import make_word_problem_datasets
from pipe_rlhf_jax.data.word_problems import (
  TEMPLATES,
  WordProblemSettings,
  main,
  make_word_problem_records,
  solve,
  worked_answer,
)

_NUMBERS = re.compile(r"\d+")


def _records(seed=0, spec=WordProblemSettings(), **kw):
  args = dict(num_prompts=300, num_demos=50, num_eval=64)
  args.update(kw)
  return make_word_problem_records(seed=seed, spec=spec, **args)


def test_same_seed_same_records_other_seed_differs_and_kinds_are_independent():
  a, b, c = _records(0), _records(0), _records(1)
  assert a == b
  assert a["prompts"] != c["prompts"] and a["prompts_eval"] != c["prompts_eval"]
  fewer = _records(0, num_demos=5)
  assert fewer["prompts"] == a["prompts"] and fewer["demos"] == a["demos"][:5]


def test_answers_are_the_arithmetic_of_the_numbers_in_the_question():
  recs = _records(3, WordProblemSettings(operations="+-*", max_operand=20, max_factor=9))
  ops = set()
  for record in recs["prompts"] + recs["prompts_eval"]:
    assert [m["role"] for m in record["messages"]] == ["user"]
    text = record["messages"][0]["content"]
    a, b = (int(x) for x in _NUMBERS.findall(text))
    candidates = {"+": a + b, "-": a - b, "*": a * b}
    assert int(record["answer"]) in candidates.values(), text
    assert int(record["answer"]) >= 0  # a take-away never goes below zero
    ops |= {op for op, v in candidates.items() if v == int(record["answer"])}
  assert {"+", "-", "*"} <= ops


def test_held_out_problems_never_occur_in_training():
  recs = _records(0, WordProblemSettings(max_operand=12), num_prompts=2000, num_eval=100)
  held = {(r["messages"][0]["content"], r["answer"]) for r in recs["prompts_eval"]}
  train = {(r["messages"][0]["content"], r["answer"]) for r in recs["prompts"]}
  assert len(held) == 100 and not held & train
  # Nor the same operands in the same phrasing under other names: the (phrasing,
  # operands) shape is what is held out.
  def shape(record):
    return _NUMBERS.findall(record["messages"][0]["content"]), record["answer"], len(
        record["messages"][0]["content"].split())
  assert len({str(shape(r)) for r in recs["prompts_eval"]}) > 50


def test_worked_answers_score_one_under_math_verify_and_wrong_ones_zero():
  problem = ("+", 0, 12, 7)
  assert solve(problem) == 19 and worked_answer(problem) == "12 + 7 = 19. The answer is 19."
  completions = [worked_answer(problem), "12 + 7 = 18.", "#### 19", "It is 19 apples."]
  scores = math_reward.math_verify(["q"] * 4, completions, ["19"] * 4)
  assert scores.tolist() == [1.0, 0.0, 1.0, 1.0]


def test_a_system_prompt_comes_first_and_every_template_is_used():
  recs = _records(0, WordProblemSettings(operations="+-*", system_prompt="Be brief."),
                  num_prompts=600)
  assert all(r["messages"][0] == {"role": "system", "content": "Be brief."}
             for r in recs["prompts"])
  assert WordProblemSettings(operations="+").num_problems() == 49 * 49 * len(TEMPLATES["+"])


@pytest.mark.parametrize("field, value, match", [
    ("operations", "+/", r"data.word_problems.operations='\+/'"),
    ("max_operand", 1, r"data.word_problems.max_operand"),
    ("bogus", 1, r"bogus"),
])
def test_bad_settings_name_the_field(field, value, match):
  with pytest.raises(ValueError, match=match):
    WordProblemSettings.from_config({field: value})


def test_too_many_held_out_problems_are_refused():
  with pytest.raises(ValueError, match="num_eval=500 is too large"):
    _records(0, WordProblemSettings(operations="+", max_operand=5), num_eval=500)


def test_data_settings_take_the_task_and_refuse_too_many_held_out(tmp_path):
  base = dict(task="word_problems", dir="", prompt_len=64, completion_len=48,
              num_prompts=10, num_demos=0, num_pairs=0, on_invalid="skip",
              on_overlong="truncate", num_eval=8,
              word_problems=dict(operations="+", max_operand=20))
  settings = DataSettings.from_config(base)
  assert settings.word_problems == WordProblemSettings(operations="+", max_operand=20)
  with pytest.raises(ValueError, match=r"data.num_eval=5000 .* data.word_problems"):
    DataSettings.from_config({**base, "num_eval": 5000,
                                       "word_problems": dict(operations="+", max_operand=4)})


def test_datasets_are_built_and_regenerated_when_the_settings_change(tmp_path):
  spec = WordProblemSettings(max_operand=9)
  built = make_word_problem_datasets(str(tmp_path), seed=0, spec=spec, num_prompts=40,
                                     num_demos=8, num_eval=6)
  assert built["prompts"].splits == {"train": 40, "eval": 6}
  first = open(built["jsonl"]["prompts"]).read()
  again = make_word_problem_datasets(str(tmp_path), seed=1, spec=spec, num_prompts=40,
                                     num_demos=8, num_eval=6)
  assert open(again["jsonl"]["prompts"]).read() != first
  record = json.loads(open(again["jsonl"]["prompts_eval"]).readline())
  assert set(record) == {"messages", "answer"}


def test_command_line_writes_the_files(tmp_path, capsys):
  main(["--out_dir", str(tmp_path), "--num_prompts", "5", "--num_demos", "2",
        "--num_eval", "3"])
  assert "prompts_eval:" in capsys.readouterr().out
  assert len(open(tmp_path / "prompts_eval.jsonl").readlines()) == 3
