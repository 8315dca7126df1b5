"""The arith task end to end (configs/grpo_arith.py): a rule-reward job without a reward
model, held-out greedy scores, and RL raising exact-match accuracy."""

import json
import os

import numpy as np
import pytest

from configs import grpo_arith

from pipe_rlhf_jax.data import rewards  # noqa: E402
from pipe_rlhf_jax.train import train  # noqa: E402


def test_tiny_arith_job_trains_no_reward_model_and_scores_held_out(tmp_path):
  config = grpo_arith.get_config("tiny")
  config.runtime.mode = "sequential"
  config.log.eval_prompts = 8
  result = train(config, str(tmp_path), progress=False)
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert {r["phase"] for r in rows} == {"data", "sft", "ppo", "heldout"}
  assert not any(k.startswith(("prefs", "build/prefs")) for k in rows[0])  # no pairs
  assert not os.path.exists(tmp_path / "data" / "arith_prefs")
  assert result["rm_eval"] is None
  # reward/mean is the exact-match rate of the sampled answers: a multiple of 1/batch.
  for r in result["ppo_metrics"]:
    assert r["reward/mean"] * config.ppo.batch_size == pytest.approx(
        round(r["reward/mean"] * config.ppo.batch_size), abs=1e-4)
  heldout = [r for r in rows if r["phase"] == "heldout"]
  assert [r["step"] for r in heldout] == [0, config.ppo.steps]
  for scores in (result["heldout_before"], result["heldout_after"]):
    assert set(scores) == {"arith_exact_match", "arith_digit_accuracy"}
    assert all(0.0 <= v <= 1.0 for v in scores.values())
  # The samples are greedy answers to held-out problems, scored by the same rule.
  prompt, completion = result["samples_after"][0].split(" -> ")
  assert rewards.arith_target(eval(prompt))  # noqa: S307 (a repr of a str)
  assert "held-out greedy arith_exact_match" in result["summary"]
  assert "reward model: none (rule reward)" in result["summary"]
  np.testing.assert_allclose(heldout[-1]["heldout/arith_exact_match"],
                             result["heldout_after"]["arith_exact_match"])


def short_learning_config():
  """A seed-fixed run small enough for the test suite: additions of one-digit numbers,
  a short SFT that leaves most sampled answers wrong, then RL against the rule."""
  config = grpo_arith.get_config("tiny")
  config.runtime.mode = "sequential"
  config.data.arith.update(operators="+", max_digits=1)
  config.data.num_eval = 16
  config.sft.update(steps=60, batch_size=32, learning_rate=1e-2)
  config.ppo.update(steps=16, batch_size=32, minibatch_size=16, epochs=2, actor_lr=3e-3,
                    critic_lr=3e-3, kl_coef=0.0)
  config.checkpoint.every = 100
  return config


@pytest.mark.slow
def test_short_rl_run_raises_exact_match(tmp_path):
  result = train(short_learning_config(), str(tmp_path), progress=False)
  accuracy = [r["reward/mean"] for r in result["ppo_metrics"]]
  print(accuracy)
  assert np.mean(accuracy[-4:]) > np.mean(accuracy[:4]) + 0.1, accuracy
