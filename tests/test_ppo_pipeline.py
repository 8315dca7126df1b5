"""End-to-end PPO on tiny configs: one step of every phase, resume, bad input, learning."""

import json
import os

import numpy as np
import pytest

from configs import quickstart  # noqa: E402

from pipe_rlhf_jax.checkpoint import CheckpointError  # noqa: E402
from pipe_rlhf_jax.ppo.registry import REWARD_FUNCTIONS  # noqa: E402
from pipe_rlhf_jax.train import train  # noqa: E402

# Metrics that measure wall time or throughput differ run to run by nature.
TIMING = ("time/", "tokens_per_s", "seconds", "bytes_per_second", "blocked_s", "wait_s")


def tiny(mode="sequential", **ppo):
  config = quickstart.get_config("tiny")
  config.runtime.mode = mode
  config.ppo.update(ppo)
  return config


def comparable(records):
  return [{k: v for k, v in r.items() if k != "time" and not any(t in k for t in TIMING)}
          for r in records]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("tiny"))
  return train(tiny(), workdir, progress=False)


def test_every_phase_runs_and_writes_its_outputs(tiny_run):
  workdir = tiny_run["workdir"]
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  phases = {r["phase"] for r in records}
  assert {"sft", "reward_model", "reward_model_eval", "ppo"} <= phases
  ppo = [r for r in records if r["phase"] == "ppo"]
  assert [r["step"] for r in ppo] == [0, 1, 2, 3]
  for key in ("reward/mean", "kl/mean", "entropy", "policy_loss", "value_loss", "clip_frac",
              "explained_variance", "response_length/mean", "time/generate_s",
              "generate/tokens_per_s", "rule_reward/mean"):
    assert key in ppo[-1] and np.isfinite(ppo[-1][key]), key
  for name in ("reward_curve.png", "trace.json", "gantt.png", "samples.txt", "summary.txt",
               "export/config.json", "export/model.safetensors"):
    assert os.path.exists(os.path.join(workdir, name)), name
  assert os.listdir(os.path.join(workdir, "checkpoints"))
  assert "reward/mean" in tiny_run["summary"]


def test_first_ppo_ratio_is_one(tiny_run):
  # Behaviour log-probs come from the sampler, the trainer recomputes them: with the
  # same weights the ratio is exactly 1 up to float rounding, so nothing is clipped at
  # the first minibatch of the first step.
  first = tiny_run["ppo_metrics"][0]
  assert abs(first["ratio_mean"] - 1.0) < 0.05


def test_resume_equals_uninterrupted(tmp_path):
  full = train(tiny(), str(tmp_path / "full"), progress=False)["ppo_metrics"]
  part = str(tmp_path / "part")
  train(tiny(), part, stop_after=2, progress=False)
  with pytest.raises(FileExistsError, match="--resume"):
    train(tiny(), part, progress=False)
  changed = tiny(kl_coef=0.5)  # changes the mathematics: the checkpoint must refuse it
  with pytest.raises(CheckpointError, match="config_fingerprint"):
    train(changed, part, resume=True, progress=False)
  config = tiny()
  config.checkpoint.every = 3  # only where/when things are written: allowed to differ
  resumed = train(config, part, resume=True, progress=False)["ppo_metrics"]
  assert [r["step"] for r in resumed] == [0, 1, 2, 3]
  assert comparable(resumed) == comparable(full)


def test_bad_config_names_the_field(tmp_path):
  config = tiny()
  config.ppo.kl_estimator = "k4"
  with pytest.raises(ValueError, match=r"ppo.kl_estimator='k4'.*k1"):
    train(config, str(tmp_path), progress=False)
  config = tiny()
  config.ppo.minibatch_size = 5
  with pytest.raises(ValueError, match="ppo.minibatch_size"):
    train(config, str(tmp_path), progress=False)
  config = tiny(mode="per_stage")
  config.stages.generate.mesh = dict(data=-1)
  config.stages.infer.mesh = dict(data=3)
  with pytest.raises(ValueError, match="stages.infer.mesh"):
    train(config, str(tmp_path / "mesh"), progress=False)


@REWARD_FUNCTIONS.register("test_letter_a_fraction")
def _letter_a_fraction(prompts, completions):
  del prompts
  return np.array([c.count("a") / max(len(c), 1) for c in completions], np.float32)


@pytest.mark.slow
def test_short_ppo_run_improves_a_rule_reward(tmp_path):
  config = tiny(steps=12, actor_lr=1e-2, critic_lr=1e-2, kl_coef=0.0, epochs=2)
  config.sft.steps = 40
  config.sft.learning_rate = 1e-2
  config.reward_model.steps = 0
  config.reward.fn = "test_letter_a_fraction"
  config.checkpoint.every = 100
  rewards = [r["reward/mean"] for r in
             train(config, str(tmp_path), progress=False)["ppo_metrics"]]
  assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.1, rewards


def test_user_jsonl_data_with_malformed_lines(tmp_path):
  # The user's own files, with one empty prompt and one line of invalid UTF-8 among them:
  # both are skipped and counted, and the run completes.
  from pipe_rlhf_jax.data import task
  paths = task.write_task_jsonl(str(tmp_path / "jsonl"), num_prompts=256, num_demos=256,
                                num_pairs=256, seed=1, num_eval=32)
  with open(paths["prompts"], "ab") as f:
    f.write(b'{"prompt": ""}\n{"prompt": "rev \\xff\\xfe="}\n'.replace(b"\\xff\\xfe", b"\xff\xfe"))
  config = tiny()
  config.data.task = "jsonl"
  config.data.jsonl.update({role: paths[role] for role in
                            ("prompts", "prompts_eval", "demos", "prefs", "prefs_eval")})
  config.reward.eval_fn = ""
  config.ppo.steps = 2
  workdir = str(tmp_path / "run")
  result = train(config, workdir, progress=False)
  assert len(result["ppo_metrics"]) == 2
  data = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))
          if '"data"' in line][0]
  assert data["build/prompts/train/skipped/empty"] == 1
  assert data["build/prompts/train/skipped/invalid_utf8"] == 1
  config.data.jsonl.prefs = str(tmp_path / "missing.jsonl")
  with pytest.raises(ValueError, match="data.jsonl.prefs"):
    train(config, str(tmp_path / "run2"), progress=False)
