"""The arith task end to end (configs/grpo_arith.py): a rule-reward job without a reward
model, held-out greedy scores, and GRPO raising exact-match accuracy."""

import json
import os

import numpy as np
import pytest

from configs import grpo_arith
from pipe_rlhf_jax.data import rewards  # noqa: E402
from pipe_rlhf_jax.train import train  # noqa: E402


def short_learning_config():
  """A seed-fixed run small enough for the test suite: additions of one-digit numbers
  (84 training facts), the tiny model on one device, an SFT that leaves most sampled
  answers wrong (about 0.17 exact), then GRPO against the rule."""
  config = grpo_arith.get_config("tiny")
  config.plan.update(mode="sequential", num_devices=1)
  config.warm_start.mesh.update(fsdp=1)  # the one device
  config.stages.generate.num_microbatches = 1
  config.data.arith.update(operators="+", max_digits=1)
  config.data.num_eval = 16
  config.sft.update(steps=150, batch_size=64, learning_rate=1e-2)
  # 32 prompts x 4 samples per step: breadth over facts is what RL needs here.
  config.ppo.update(steps=24, batch_size=128, minibatch_size=64, epochs=2, actor_lr=1e-3,
                    kl_coef=0.0)
  config.checkpoint.every = 100
  config.log.eval_prompts = 16  # greedy answers are stateless: the RL run is unchanged
  return config


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("arith")
  config = short_learning_config()
  return config, workdir, train(config, str(workdir), progress=False)


@pytest.mark.slow
def test_rule_reward_job_trains_no_reward_model_and_scores_held_out(short_run):
  config, workdir, result = short_run
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  assert {r["phase"] for r in rows} == {"data", "plan", "sft", "ppo", "heldout"}
  assert not any(k.startswith(("prefs", "build/prefs")) for k in rows[0])  # no pairs
  assert not os.path.exists(workdir / "data" / "arith_prefs")
  assert result.rm_eval is None
  # reward/mean is the exact-match rate of the sampled answers: a multiple of 1/batch.
  for r in result.ppo_metrics:
    hits = r["reward/mean"] * config.ppo.batch_size
    assert hits == pytest.approx(round(hits), abs=1e-4)
  heldout = [r for r in rows if r["phase"] == "heldout"]
  assert [r["step"] for r in heldout] == [0, config.ppo.steps]
  for scores in (result.heldout_before, result.heldout_after):
    assert set(scores) == {"arith_exact_match", "arith_digit_accuracy"}
    assert all(0.0 <= v <= 1.0 for v in scores.values())
  np.testing.assert_allclose(heldout[-1]["heldout/arith_exact_match"],
                             result.heldout_after["arith_exact_match"])
  # The samples are greedy answers to held-out problems of the task.
  prompt, _ = result.samples_after[0].split(" -> ")
  assert rewards.arith_target(eval(prompt))  # noqa: S307 (the repr of a str)
  assert "held-out greedy arith_exact_match" in result.summary
  assert "reward model: none (a rule or the environment gives the reward)" in result.summary


@pytest.mark.slow
def test_short_grpo_run_raises_exact_match(short_run):
  # A run of this config: exact match of the sampled answers 0.17 over the
  # first 6 steps, 0.30 over the last 6 (sequential mode is deterministic for a seed).
  config, _, result = short_run
  assert config.ppo.advantage_estimator == "grpo"
  accuracy = [r["reward/mean"] for r in result.ppo_metrics]
  assert len(accuracy) == 24
  assert np.mean(accuracy[-6:]) > np.mean(accuracy[:6]) + 0.05, accuracy
