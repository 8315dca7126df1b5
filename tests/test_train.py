"""End-to-end PPO on tiny configs: every phase, resume (after Ctrl-C, a crash, onto another
plan), bad input, learning."""

import _thread
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from pipe_rlhf_jax.checkpoint import CheckpointError  # noqa: E402
from pipe_rlhf_jax.ppo.registry import REWARD_FUNCTIONS  # noqa: E402
from pipe_rlhf_jax.train import experiment_of, train  # noqa: E402
from tests.helpers.configs import tiny_quickstart  # noqa: E402
from tests.helpers.metric_helpers import assert_metrics_close  # noqa: E402
from tests.helpers.xla_env import child_env  # noqa: E402

# Metrics that measure wall time or throughput differ run to run by nature.
TIMING = ("time/", "tokens_per_s", "seconds", "bytes_per_second", "blocked_s", "wait_s")


def tiny(mode="sequential", **ppo):
  """The tiny quickstart, sequential unless told (this file's baseline), with `ppo` fields."""
  return tiny_quickstart(mode, {f"ppo.{key}": value for key, value in ppo.items()})


def comparable(records):
  return [{k: v for k, v in r.items() if k != "time" and not any(t in k for t in TIMING)}
          for r in records]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("tiny"))
  return train(tiny(), workdir, progress=False)


def test_every_phase_runs_and_writes_its_outputs(tiny_run):
  workdir = tiny_run.workdir
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
  assert "reward/mean" in tiny_run.summary


def test_a_failed_export_leaves_the_previous_one_whole(tmp_path, monkeypatch):
  from pipe_rlhf_jax.models import hf
  from pipe_rlhf_jax.models.config import tiny_config
  from pipe_rlhf_jax.models.transformer import init_model
  from pipe_rlhf_jax.phases.reporting import export_policy

  def files(directory):
    return {name: open(os.path.join(directory, name), "rb").read()
            for name in sorted(os.listdir(directory))}

  cfg = tiny_config(vocab_size=264, embed_dim=16, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=8, mlp_dim=32)
  export = str(tmp_path / "export")
  export_policy(init_model(cfg, seed=0), export)
  before = files(export)
  write = hf.write_safetensors

  def dies_half_way(path, tensors):
    write(path, dict(list(tensors.items())[:2]))  # some tensors on disk, then the failure
    raise OSError("No space left on device")

  monkeypatch.setattr(hf, "write_safetensors", dies_half_way)
  with pytest.raises(OSError, match="No space left"):
    export_policy(init_model(cfg, seed=1), export)
  assert files(export) == before
  assert sorted(os.listdir(tmp_path)) == ["export"]  # no half-written directory beside it
  # Stopped between the renames: the previous export waits beside, and is put back.
  os.rename(export, export + ".previous")
  with pytest.raises(OSError, match="No space left"):
    export_policy(init_model(cfg, seed=1), export)
  assert files(export) == before
  monkeypatch.setattr(hf, "write_safetensors", write)
  export_policy(init_model(cfg, seed=1), export)
  after = files(export)
  assert sorted(after) == sorted(before) and after != before
  assert sorted(os.listdir(tmp_path)) == ["export"]
  assert hf.from_pretrained(export).config.num_layers == 1


def test_first_ppo_ratio_is_one(tiny_run):
  # Behaviour log-probs come from the sampler, the trainer recomputes them: with the
  # same weights the ratio is exactly 1 up to float rounding, so nothing is clipped at
  # the first minibatch of the first step.
  first = tiny_run.ppo_metrics[0]
  assert abs(first["ratio_mean"] - 1.0) < 0.05


def test_resume_equals_uninterrupted(tmp_path, tiny_run):
  full = tiny_run.ppo_metrics
  part = str(tmp_path / "part")
  train(tiny(), part, stop_after=2, progress=False)
  with pytest.raises(FileExistsError, match="--resume"):
    train(tiny(), part, progress=False)
  changed = tiny(kl_coef=0.25)  # changes the mathematics: the checkpoint must refuse it
  with pytest.raises(CheckpointError, match="config_fingerprint"):
    train(changed, part, resume=True, progress=False)
  config = tiny()
  config.checkpoint.every = 3  # only where/when things are written: allowed to differ
  # Built before and handed over typed: the same run as `train(config)`.
  resumed = train(experiment_of(config), part, resume=True, progress=False).ppo_metrics
  assert [r["step"] for r in resumed] == [0, 1, 2, 3]
  assert comparable(resumed) == comparable(full)


def test_an_experiment_is_checked_frozen_and_planned_before_anything_is_written(tmp_path):
  import ml_collections

  from pipe_rlhf_jax.config import Plan, PPOSettings
  config = tiny()
  experiment = experiment_of(config)
  assert experiment.ppo == PPOSettings.from_config(config.ppo, seed=config.seed)
  assert experiment.plan == Plan.from_config(config)  # the hand-written plan
  assert not experiment.planned.chosen and experiment.record.to_dict() == config.to_dict()
  assert experiment.models["actor"].vocab_size >= 1
  with pytest.raises(dataclasses.FrozenInstanceError):
    experiment.settings.ppo.kl_coef = 0.0  # frozen: a run cannot change its settings
  with pytest.raises(dataclasses.FrozenInstanceError):
    experiment.settings.data = None
  config.plan.choose = "auto"
  auto = experiment_of(config)
  assert auto.planned.chosen and auto.planned.predicted_step_s > 0
  # The record is the config with the chosen plan written in, as config.json holds it.
  assert auto.record.plan.mode == auto.plan.mode
  assert isinstance(auto.record, ml_collections.FrozenConfigDict)
  assert auto.record.plan.choose == auto.settings.choice.choose == "auto"
  # A config the planner rejects fails here, before the workdir exists.
  config = tiny()
  config.ppo.update(batch_size=10, minibatch_size=10)
  workdir = str(tmp_path / "never")
  with pytest.raises(ValueError, match="batch"):
    train(config, workdir, progress=False)
  assert not os.path.exists(workdir)


def ppo_rows(workdir):
  return [r for r in (json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")))
          if r["phase"] == "ppo"]


_ARMED = {"interrupt": False}


@REWARD_FUNCTIONS.register("test_ctrl_c_when_armed")
def _ctrl_c_when_armed(prompts, completions):
  del prompts
  if _ARMED["interrupt"]:
    _ARMED["interrupt"] = False
    _thread.interrupt_main()  # Ctrl-C, in the middle of the step's inference
  return np.array([c.count("a") / max(len(c), 1) for c in completions], np.float32)


@pytest.mark.slow
def test_ctrl_c_right_after_resume_stops_cleanly(tmp_path):
  # The restored checkpoint is the newest on disk; a Ctrl-C inside the first resumed
  # step finishes that step and saves it as a new one (never the restored step again,
  # which would be a CheckpointExistsError).
  config = tiny()
  config.reward.fn = "test_ctrl_c_when_armed"
  config.ppo.critic_init = "sft"  # a rule reward trains no reward model
  workdir = str(tmp_path)
  train(config, workdir, stop_after=2, progress=False)
  _ARMED["interrupt"] = True
  with pytest.raises(KeyboardInterrupt):
    train(config, workdir, resume=True, progress=False)
  assert sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints"))
                if s.isdigit()) == [1, 2]
  resumed = train(config, workdir, resume=True, progress=False)
  assert [r["step"] for r in resumed.ppo_metrics] == [0, 1, 2, 3]


@pytest.mark.slow
def test_crash_and_resume_leave_each_step_once_in_the_metrics(tmp_path, tiny_run):
  # A real `kill -9` right after step 3's row is written (checkpoints every 2 steps: the
  # newest is step 1, so steps 2 and 3 are trained again on resume). Their rows from the
  # killed run must be replaced, not kept beside the new ones.
  workdir = str(tmp_path / "run")
  code = f"""
import os, signal, sys, time
sys.path.insert(0, {os.path.join(os.path.dirname(__file__), "..")!r})
import jax
jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
from pipe_rlhf_jax import metrics
from pipe_rlhf_jax.train import train
from tests.helpers.configs import tiny_quickstart

write = metrics.MetricsWriter.write

def write_then_die(self, step, values, phase="ppo"):
  record = write(self, step, values, phase)
  if phase == "ppo" and step == 3:
    # Step 1's checkpoint is written in the background: let it land first, so that the
    # resume starts at step 2 (step 3's save has not begun: it follows this row).
    deadline = time.monotonic() + 300
    while not os.path.isdir(os.path.join({workdir!r}, "checkpoints", "1")):
      assert time.monotonic() < deadline, "step 1's checkpoint never appeared"
      time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)
  return record

metrics.MetricsWriter.write = write_then_die
config = tiny_quickstart("sequential")
assert config.checkpoint.every == 2
train(config, {workdir!r}, progress=False)
"""
  env = child_env(8)
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=600, env=env, cwd=os.path.join(os.path.dirname(__file__), ".."))
  assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
  assert [r["step"] for r in ppo_rows(workdir)] == [0, 1, 2, 3]
  assert [d for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit()] == ["1"]
  resumed = train(tiny(), workdir, resume=True, progress=False)
  # The log, and what is computed from it, hold each step once, equal to a run that was
  # never killed (the same programs on the same devices: equal to the last bit).
  assert comparable(ppo_rows(workdir)) == comparable(tiny_run.ppo_metrics)
  assert comparable(resumed.ppo_metrics) == comparable(tiny_run.ppo_metrics)
  assert [r["phase"] for r in map(json.loads, open(os.path.join(workdir, "metrics.jsonl")))
          ].count("data") == 1


@pytest.mark.slow
def test_resume_on_fewer_devices_in_another_mode(tmp_path, caplog):
  # Preempted on 8 devices in `pipe` mode, continued on 4 in `sequential` mode on another
  # mesh: the plan is not part of the fingerprint, but changing the staleness bound
  # (pipe with max_staleness=1 -> sequential) changes what is computed, which is logged.
  workdir = str(tmp_path)
  config = tiny(mode="pipe")
  config.stages.generate.mesh = dict(data=-1)  # the plain sampler: less to compile
  train(config, workdir, stop_after=2, progress=False)
  config = tiny(mode="sequential")
  config.plan.num_devices = 4
  config.mesh.update(data=2, fsdp=2)
  with caplog.at_level(logging.WARNING, logger="pipe_rlhf_jax.train"):
    resumed = train(config, workdir, resume=True, progress=False)
  assert [r["step"] for r in resumed.ppo_metrics] == [0, 1, 2, 3]
  assert "num_devices: 8 -> 4" in caplog.text and "mode: 'pipe' -> 'sequential'" in caplog.text
  assert "changes what PPO computes" in caplog.text
  from pipe_rlhf_jax.checkpoint import Checkpointer
  with Checkpointer(os.path.join(workdir, "checkpoints")) as ckpt:
    plan = ckpt.read_metadata(3)["plan"]
  assert plan["num_devices"] == 4 and plan["mode"] == "sequential"


@pytest.mark.slow
def test_resume_on_another_mesh_gives_the_uninterrupted_metrics(tmp_path, tiny_run):
  # 2 steps on data=8, then 2 on data=2 x fsdp=4, against 4 steps on data=8. (Not
  # tensor=2: the tiny model has one kv head.) The same mathematics; only the order of
  # floating-point reductions (gradients summed over 8 data shards vs over 2 data shards
  # of parameters split 4 ways) differs, which moves float32 results in their last bits
  # and, through the optimizer steps, to relative differences ~1e-6.
  # Tolerance rtol 1e-5 / atol 1e-6; clip fractions count tokens past a threshold, so
  # they may differ by one token's worth (0.02).
  part = str(tmp_path)
  train(tiny(), part, stop_after=2, progress=False)
  config = tiny()
  config.mesh.update(data=2, fsdp=4)
  resumed = comparable(train(config, part, resume=True, progress=False).ppo_metrics)
  full = comparable(tiny_run.ppo_metrics)
  assert [r["step"] for r in resumed] == [0, 1, 2, 3]
  assert resumed[:2] == full[:2]  # written by the first run, on the same mesh
  assert_metrics_close(full[2:], resumed[2:], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_log_every_writes_every_nth_row_and_the_last(tmp_path):
  config = tiny(steps=3)
  config.log.every = 2
  result = train(config, str(tmp_path), progress=False)
  assert [r["step"] for r in result.ppo_metrics] == [1, 2]
  assert sorted(int(s) for s in os.listdir(os.path.join(str(tmp_path), "checkpoints"))
                if s.isdigit()) == [1, 2]  # checkpoints do not depend on log.every


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
  config = tiny()
  config.plan.num_devices = 9
  with pytest.raises(ValueError, match=r"plan.num_devices=9 but only 8 devices"):
    train(config, str(tmp_path / "devices"), progress=False)
  # All of these fail before any data are built.
  assert not os.path.exists(os.path.join(str(tmp_path), "mesh", "data"))


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
  config.ppo.critic_init = "sft"  # a rule reward trains no reward model
  config.checkpoint.every = 100
  rewards = [r["reward/mean"] for r in
             train(config, str(tmp_path), progress=False).ppo_metrics]
  assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.1, rewards


def jsonl_config(directory):
  """The tiny config on the user's own files (the reverse task written as JSONL)."""
  from pipe_rlhf_jax.data import task
  paths = task.write_task_jsonl(str(directory), num_prompts=256, num_demos=256,
                                num_pairs=256, seed=1, num_eval=32)
  config = tiny()
  config.data.task = "jsonl"
  config.data.jsonl.update({role: paths[role] for role in
                            ("prompts", "prompts_eval", "demos", "prefs", "prefs_eval")})
  config.reward.eval_fn = ""
  return config, paths


def test_resume_refuses_data_edited_in_place(tmp_path):
  # A JSONL file edited under the same path is other data: the resumed run would continue
  # at the checkpoint's index into different records.
  config, paths = jsonl_config(tmp_path / "jsonl")
  config.ppo.steps = 2
  workdir = str(tmp_path / "run")
  train(config, workdir, stop_after=1, progress=False)
  original = open(paths["prompts"], "rb").read()
  with open(paths["prompts"], "ab") as f:
    f.write(b'{"prompt": "rev zz="}\n')
  before = sorted(os.listdir(workdir))
  with pytest.raises(CheckpointError, match=r"checkpoint .*checkpoints/0 was trained on other "
                                            r"data: data.jsonl.prompts='.*prompts.jsonl' "
                                            r"holds other data .*restore the file, or use a "
                                            r"new workdir"):
    train(config, workdir, resume=True, progress=False)
  assert sorted(os.listdir(workdir)) == before  # refused before anything was written
  with open(paths["prompts"], "wb") as f:  # the same bytes again: the run resumes
    f.write(original)
  resumed = train(config, workdir, resume=True, progress=False)
  assert [r["step"] for r in resumed.ppo_metrics] == [0, 1]


@pytest.mark.slow
def test_user_jsonl_data_with_malformed_lines(tmp_path):
  # The user's own files, with one empty prompt and one line of invalid UTF-8 among them:
  # both are skipped and counted, and the run completes.
  config, paths = jsonl_config(tmp_path / "jsonl")
  with open(paths["prompts"], "ab") as f:
    f.write(b'{"prompt": ""}\n{"prompt": "rev \\xff\\xfe="}\n'.replace(b"\\xff\\xfe", b"\xff\xfe"))
  config.ppo.steps = 2
  workdir = str(tmp_path / "run")
  result = train(config, workdir, progress=False)
  assert len(result.ppo_metrics) == 2
  data = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))
          if '"data"' in line][0]
  assert data["build/prompts/train/skipped/empty"] == 1
  assert data["build/prompts/train/skipped/invalid_utf8"] == 1
  config.data.jsonl.prefs = str(tmp_path / "missing.jsonl")
  with pytest.raises(ValueError, match="data.jsonl.prefs"):
    train(config, str(tmp_path / "run2"), progress=False)


@pytest.mark.slow
def test_partial_rollouts_resume_with_the_prompts_they_held(tmp_path, monkeypatch):
  # pipe mode, 4 slots: a stop after step 2 checkpoints the prompts read and not yet
  # trained; the resumed run's engine queues exactly those first.
  from pipe_rlhf_jax.stages import rollout_stream
  config = tiny("pipe")
  config.plan.partial_rollouts = True
  config.stages.generate.num_slots = 4
  config.stages.generate.mesh.pipeline = 1
  config.stages.generate.mesh.data = 2
  workdir = str(tmp_path)
  train(config, workdir, stop_after=2, progress=False)
  meta_path = os.path.join(workdir, "checkpoints", "1", "metadata", "metadata")
  held = json.load(open(meta_path))["data_state"]["in_flight"]
  assert held
  queued = []
  original = rollout_stream.RolloutStream.__init__

  def spy(self, *args, **kwargs):
    queued.append([r["index"]["data"] for r in kwargs.get("in_flight", [])])
    original(self, *args, **kwargs)

  monkeypatch.setattr(rollout_stream.RolloutStream, "__init__", spy)
  resumed = train(config, workdir, resume=True, progress=False)
  assert [r["step"] for r in resumed.ppo_metrics] == [0, 1, 2, 3]
  assert queued == [[r["index"]["data"] for r in held]]
