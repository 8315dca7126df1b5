"""configs/rlvr_math.py end to end: chat prompts with answers, GRPO against math_verify.

A tiny LLaMA with a character-level ChatML tokenizer (written here) runs the `:tiny`
variant on the shipped sample (configs/data/math_*.jsonl) through `train`. The checker
of the math rule is the real one, watched: the rewards of every PPO step are the scores
it returned, for the references of the training prompts.
"""

import glob
import json
import os

import numpy as np
import pytest

pytest.importorskip("math_verify")

from configs import rlvr_math  # noqa: E402
from pipe_rlhf_jax.data import math_reward  # noqa: E402
from pipe_rlhf_jax.train import train  # noqa: E402
from tests.helpers.hf_helpers import write_tiny_chat_llama  # noqa: E402


def _records(name):
  with open(os.path.join(rlvr_math.DATA, name), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _corpus() -> str:
  """Every character of the sample's text (and of the template's markers)."""
  text = []
  for path in sorted(glob.glob(os.path.join(rlvr_math.DATA, "math_*.jsonl"))):
    for record in _records(os.path.basename(path)):
      text += [m["content"] for m in record["messages"]]
      text += [record.get("completion", ""), record.get("answer", "")]
  return "".join(text) + "systemuserassistant\n"


def test_shipped_demonstrations_verify_against_their_answers():
  # The sample's worked solutions end in "#### <answer>": each must earn reward 1.
  demos, prompts = _records("math_demos.jsonl"), _records("math_prompts.jsonl")
  assert len(demos) == len(prompts) == 24 and len(_records("math_prompts_eval.jsonl")) == 8
  assert [d["messages"] for d in demos] == [p["messages"] for p in prompts]
  scores = math_reward.math_verify(["q"] * 24, [d["completion"] for d in demos],
                                   [p["answer"] for p in prompts])
  np.testing.assert_array_equal(scores, np.ones(24, np.float32))


class _Watched(math_reward.AnswerChecker):
  """The real checker, remembering what it was asked and what it answered."""

  def __init__(self):
    super().__init__()
    self.calls = []

  def score(self, answers, completions):
    scores = super().score(answers, completions)
    self.calls.append((list(answers), list(completions), scores))
    return scores


# Slow: the math rule itself is tested in tests/data/test_math_reward.py, and the main
# job end to end by tests/test_train.py.
@pytest.mark.slow
def test_tiny_rlvr_math_trains_against_the_math_rule(tmp_path, monkeypatch):
  model_dir = write_tiny_chat_llama(str(tmp_path / "tiny-chat"), _corpus())
  watched = _Watched()
  monkeypatch.setattr(math_reward, "_CHECKER", watched)
  config = rlvr_math.get_config("tiny")
  config.model.path = model_dir
  try:
    result = train(config, str(tmp_path / "run"), progress=False)
  finally:
    watched.close()
  ppo = result.ppo_metrics
  assert len(ppo) == config.ppo.steps == 3
  assert config.ppo.advantage_estimator == "grpo" and config.ppo.group_size == 2
  # Held-out greedy answers before and after RL (8 prompts each), then one call per step.
  heldout, steps = watched.calls[:1], watched.calls[1:1 + len(ppo)]
  assert len(watched.calls) == 2 + len(ppo)
  assert len(heldout[0][0]) == 8 and len(watched.calls[-1][0]) == 8
  train_answers = {r["answer"] for r in _records("math_prompts.jsonl")}
  for row, (answers, completions, scores) in zip(ppo, steps):
    assert len(answers) == config.ppo.batch_size and set(answers) <= train_answers
    assert answers[0::2] == answers[1::2]  # each prompt's 2 samples share its answer
    assert set(np.unique(scores)) <= {0.0, 1.0}
    np.testing.assert_allclose(row["reward/mean"], scores.mean(), atol=1e-7)
    hits = row["reward/mean"] * config.ppo.batch_size
    assert hits == pytest.approx(round(hits), abs=1e-4)
  eval_answers = [r["answer"] for r in _records("math_prompts_eval.jsonl")]
  assert heldout[0][0] == eval_answers  # the held-out split, in file order
  assert set(result.heldout_before) == set(result.heldout_after) == {"math_verify"}
  rows = [json.loads(line) for line in
          (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  data_row = next(r for r in rows if r["phase"] == "data")
  assert data_row["prompts/records/kept"] == 24 and data_row["demos/records/kept"] == 24
  assert [r["step"] for r in rows if r["phase"] == "heldout"] == [0, config.ppo.steps]
  # The samples show prompts rendered by the chat template (its markers are specials,
  # dropped when decoding), ending in the generation prompt.
  prompt = eval(result.samples_after[0].split(" -> ")[0])  # noqa: S307 (a str repr)
  assert prompt.startswith("system\nSolve the problem") and prompt.endswith("assistant\n")


def test_config_errors_name_the_fields():
  from configs import grpo_arith
  from pipe_rlhf_jax.config import ExperimentSettings
  with pytest.raises(ValueError, match="model.path is required"):
    ExperimentSettings.from_config(rlvr_math.get_config())
  config = grpo_arith.get_config("tiny")
  config.reward.fn = "math_verify"
  with pytest.raises(ValueError, match=r"reward.fn='math_verify' checks each completion "
                                       r"against its prompt's reference answer, but the "
                                       r"prompts of data.task='arith' carry none"):
    ExperimentSettings.from_config(config)
