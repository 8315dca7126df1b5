"""Episodes in the main job: the `env` config section, its checks, the held-out episodes
and resume, on the tiny quickstart with a scripted environment."""

import json
import os

import pytest

from pipe_rlhf_jax.config import ExperimentSettings
from pipe_rlhf_jax.train import train
from tests.envs.test_episodes import Echo  # noqa: F401  (registers "test_echo")
from tests.helpers.configs import tiny_quickstart

EPISODES = {"env.name": "test_echo", "env.turn_tokens": 4, "reward.fn": "environment",
            "reward.eval_fn": "", "data.completion_len": 40, "ppo.critic_init": "sft",
            "ppo.steps": 2, "sft.steps": 0}


def _heldout_rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if '"heldout"' in line]


@pytest.mark.long
def test_the_main_job_trains_on_episodes(tmp_path):
  config = tiny_quickstart("sequential", EPISODES)
  result = train(config, str(tmp_path), progress=False)
  assert len(result.ppo_metrics) == config.ppo.steps
  for m in result.ppo_metrics:
    assert m["env/turns"] >= 1 and "env/end/done" in m and "reward/mean" in m
  heldout = _heldout_rows(tmp_path)
  assert heldout and all("heldout/test_echo" in r for r in heldout)


# Extended: CI holds resume equal to uninterrupted for one-turn rollouts
# (tests/test_train.py); episodes keep no state between steps.
@pytest.mark.slow
@pytest.mark.extended
def test_a_resumed_episode_run_equals_the_uninterrupted_one(tmp_path):
  config = tiny_quickstart("sequential", EPISODES)
  whole = train(config, str(tmp_path / "whole"), progress=False)
  half = tmp_path / "half"
  train(config, str(half), progress=False, stop_after=1)
  resumed = train(config, str(half), progress=False, resume=True)
  keys = ("reward/mean", "env/turns", "policy_loss", "env/policy_tokens")
  assert ([{k: m[k] for k in keys} for m in resumed.ppo_metrics[-1:]]
          == [{k: m[k] for k in keys} for m in whole.ppo_metrics[-1:]])


@pytest.mark.parametrize("overrides, message", [
    ({"env.name": "test_echo"}, "reward.fn"),
    ({"reward.fn": "environment"}, "env.name"),
    ({**EPISODES, "reward.eval_fn": "reverse_accuracy"}, "reward.eval_fn"),
    ({**EPISODES, "env.name": "no_such"}, "env.name"),
    ({**EPISODES, "env.max_turns": 0}, "env.max_turns"),
])
def test_bad_episode_settings_name_the_field(overrides, message):
  with pytest.raises(ValueError, match=message):
    ExperimentSettings.from_config(tiny_quickstart("sequential", overrides))
