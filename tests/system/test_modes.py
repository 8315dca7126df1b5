"""The three modes on tiny configs: equivalence, overlap, faults and interrupts."""

import _thread
import json
import os
import threading
import time

import numpy as np
import pytest

from pipe_rlhf_jax.concurrency.weights import StalenessGate  # noqa: E402
from pipe_rlhf_jax.ppo.registry import REWARD_FUNCTIONS  # noqa: E402
from pipe_rlhf_jax.train import train  # noqa: E402
from tests.helpers.configs import tiny_quickstart  # noqa: E402
from tests.helpers.metric_helpers import assert_metrics_close  # noqa: E402

# Quantities whose value depends on wall time or on the schedule, not on the mathematics.
NOT_MATH = ("time", "tokens_per_s", "transfer/", "queue/", "weights/", "staleness/")


def tiny(mode, pipelined=False, **plan):
  config = tiny_quickstart(mode, {f"plan.{key}": value for key, value in plan.items()})
  if not pipelined:
    # A data-parallel generate stage; `pipelined=True` keeps the tiny variant's 2-stage
    # pipelined decoder on devices 0-1.
    config.stages.generate.mesh = dict(data=-1)
  return config


def math_metrics(records):
  return [{k: v for k, v in r.items() if not any(k.startswith(p) or p in k for p in NOT_MATH)}
          for r in records]


def assert_same_math(expected, actual):
  """Continuous metrics at rtol 1e-4 / atol 1e-5 (clip fractions: see the helper)."""
  assert_metrics_close(math_metrics(expected), math_metrics(actual), rtol=1e-4, atol=1e-5)


@pytest.mark.long
def test_pipe_with_zero_staleness_matches_sequential(tmp_path):
  # Same seed, same data order, on-policy: only the placement and layouts differ (8 shared
  # devices vs 2 + 2 + 4 disjoint ones), so reductions may sum in a different order. Tolerance: see
  # assert_same_math; sampled tokens agree exactly (equal response lengths and rule
  # rewards are among the compared metrics).
  # The pipe run generates with the delayed pipelined decoder (P=2, M=4), the sequential
  # run with the plain sampler: the rollouts must still be the same tokens.
  # The warm start is the same in every mode: the pipe run restores the sequential run's
  # instead of training it again.
  seq = train(tiny("sequential"), str(tmp_path / "seq"), progress=False).ppo_metrics
  config = tiny("pipe", pipelined=True, max_staleness=0)
  config.warm_start.checkpoint = str(tmp_path / "seq" / "warmstart")
  pipe = train(config, str(tmp_path / "pipe"), progress=False).ppo_metrics
  assert len(seq) == len(pipe) == 4
  assert_same_math(seq, pipe)


@REWARD_FUNCTIONS.register("test_distinct_letters")
def _distinct_letters(prompts, completions):
  # Varies between the samples of one prompt, so group advantages are not all zero.
  del prompts
  return np.array([len(set(c)) / max(len(c), 1) for c in completions], np.float32)


@pytest.mark.slow
def test_grpo_pipe_with_zero_staleness_matches_sequential(tmp_path):
  # Critic-free GRPO, 4 samples per prompt generated together (in the pipe run by the
  # pipelined decoder, P=2, M=4), KL to the reference in the loss: the same mathematics
  # in both schedules, at the tolerance of the PPO test above.
  def grpo(config):
    config.reward.fn = "test_distinct_letters"
    config.ppo.update(advantage_estimator="grpo", group_size=4, whiten_advantages=False,
                      kl_in="loss", kl_estimator="k3")
    return config

  seq = train(grpo(tiny("sequential")), str(tmp_path / "seq"), progress=False)
  pipe = train(grpo(tiny("pipe", pipelined=True, max_staleness=0)), str(tmp_path / "pipe"),
               progress=False)
  seq, pipe = seq.ppo_metrics, pipe.ppo_metrics
  assert len(seq) == len(pipe) == 4
  assert_same_math(seq, pipe)
  # Not vacuous: the groups' returns differ, the KL loss acts, and no critic ran.
  assert all(r["reward/std"] > 0.01 and r["kl_coef"] > 0 for r in seq)
  assert max(r["kl_loss"] for r in seq) > 0 and max(abs(r["policy_loss"]) for r in seq) > 0
  assert not any("value" in k or "critic" in k for r in pipe for k in r)


# Extended: a variant of the default tier's pipe-equals-sequential case. CI still runs
# PPO-ptx in pipe mode (the quickstart's own setting, in every main-job test) and holds the
# term to the SFT loss (tests/stages/test_ppo_stages.py); this adds the rows' equality.
@pytest.mark.slow
@pytest.mark.extended
def test_ptx_pipe_with_zero_staleness_matches_sequential(tmp_path):
  # PPO-ptx: the SFT term's demonstrations are drawn from the seed and the step, so both
  # schedules train on the same rows (8 per step: the tiny minibatch).
  def ptx(config):
    config.ppo.ptx_coef = 0.5
    return config

  seq = train(ptx(tiny("sequential")), str(tmp_path / "seq"), progress=False).ppo_metrics
  pipe = train(ptx(tiny("pipe", pipelined=True, max_staleness=0)), str(tmp_path / "pipe"),
               progress=False).ppo_metrics
  assert len(seq) == len(pipe) == 4
  assert_same_math(seq, pipe)
  assert all(r["ptx_loss"] > 0 for r in seq)  # not vacuous: the term ran
  config = ptx(tiny("sequential"))
  config.ppo.ptx_batch_size = 4  # 8 data shards in sequential mode
  with pytest.raises(ValueError, match=r"ppo.ptx_batch_size: 4 demonstrations .* 8 batch"):
    train(config, str(tmp_path / "bad"), progress=False)


_BATCH_1_HAS_WEIGHTS = threading.Event()


@REWARD_FUNCTIONS.register("test_slow_until_batch_1_has_weights")
def _slow_until_batch_1_has_weights(prompts, completions):
  # A slow first reward: batch 0 cannot be trained (so version 1 cannot exist) before the
  # generator has taken its weights for batch 1, which must therefore be version 0.
  _BATCH_1_HAS_WEIGHTS.wait(timeout=300)
  return np.array([c.count("a") / max(len(c), 1) for c in completions], np.float32)


# The off-policy machinery is the same for a critic-free estimator (rloo: groups of 4).
CRITIC_FREE = dict(advantage_estimator="rloo", group_size=4, whiten_advantages=False)


@pytest.mark.parametrize("algorithm", [
    pytest.param(dict(kl_policy="proximal"), id="gae"),
    pytest.param(CRITIC_FREE, id="rloo", marks=pytest.mark.slow)])
def test_pipe_with_staleness_overlaps_generation_and_training(tmp_path, monkeypatch,
                                                              algorithm):
  _BATCH_1_HAS_WEIGHTS.clear()
  acquire = StalenessGate.acquire

  def acquire_and_tell(self, batch_index, *args, **kwargs):
    out = acquire(self, batch_index, *args, **kwargs)
    if batch_index == 1:
      _BATCH_1_HAS_WEIGHTS.set()
    return out

  monkeypatch.setattr(StalenessGate, "acquire", acquire_and_tell)
  config = tiny("pipe", pipelined=True, max_staleness=1)
  config.ppo.steps = 6
  config.ppo.loss = "decoupled_ppo_clip"  # the off-policy objective stale rollouts need
  config.reward.fn = "test_slow_until_batch_1_has_weights"
  config.ppo.critic_init = "sft"  # a rule reward trains no reward model
  config.ppo.update(algorithm)
  result = train(config, str(tmp_path), progress=False)
  tracer = result.tracer
  # Generation of batch k+1 ran while batch k was in inference or training.
  assert tracer.overlap("generate", "train") + tracer.overlap("generate", "infer") > 0
  lags = [r["staleness/actor"] for r in result.ppo_metrics]
  assert max(lags) <= 1 and min(lags) >= 0
  assert lags[0] == 0 and lags[1] == 1  # a lag of 1 was used, not only allowed
  # Decoupled objective: behaviour importance weights are reported and capped.
  assert all(0 < r["iw_mean"] and r["iw_max"] < 1e3 for r in result.ppo_metrics)
  # The proximal policy's KL is reported (and, with kl_policy="proximal", penalised).
  # (k1 of tokens another policy sampled may be negative.)
  assert all(np.isfinite(r["kl_proximal/mean"]) for r in result.ppo_metrics)
  trace = json.load(open(os.path.join(str(tmp_path), "trace.json")))
  stages = {e["args"].get("batch") for e in trace["traceEvents"] if e.get("ph") == "X"}
  assert set(range(6)) <= stages
  assert os.path.getsize(os.path.join(str(tmp_path), "gantt.png")) > 0
  busy = result.busy_fraction
  assert all(0 < busy[s] <= 1 for s in ("generate", "infer", "train"))


_CALLS = {"n": 0}


@REWARD_FUNCTIONS.register("test_fails_on_second_batch")
def _fails(prompts, completions):
  _CALLS["n"] += 1
  if _CALLS["n"] == 2:
    raise ZeroDivisionError("reward server exploded")
  return np.zeros(len(prompts), np.float32)


def test_worker_exception_stops_everything_and_reraises(tmp_path):
  _CALLS["n"] = 0
  config = tiny("pipe", max_staleness=1)
  config.reward.fn = "test_fails_on_second_batch"
  config.ppo.critic_init = "sft"  # a rule reward trains no reward model
  config.reward.eval_fn = ""
  start = time.perf_counter()
  with pytest.raises(ZeroDivisionError, match="reward server exploded") as info:
    train(config, str(tmp_path), progress=False)
  assert any("infer" in note for note in getattr(info.value, "__notes__", []))
  assert time.perf_counter() - start < 300


_INTERRUPT = {"n": 0, "at": 3}


@REWARD_FUNCTIONS.register("test_ctrl_c_on_third_batch")
def _ctrl_c(prompts, completions):
  _INTERRUPT["n"] += 1
  if _INTERRUPT["n"] == _INTERRUPT["at"]:
    _thread.interrupt_main()
  return np.array([c.count("a") / max(len(c), 1) for c in completions], np.float32)


@pytest.mark.slow
def test_ctrl_c_writes_a_final_checkpoint_and_resume_loses_nothing(tmp_path):
  _INTERRUPT["n"] = 0
  config = tiny("pipe", max_staleness=1)
  config.reward.fn = "test_ctrl_c_on_third_batch"
  config.ppo.critic_init = "sft"  # a rule reward trains no reward model
  config.checkpoint.every = 100  # only the interrupt writes one
  config.ppo.steps = 6
  workdir = str(tmp_path)
  with pytest.raises(KeyboardInterrupt):
    train(config, workdir, progress=False)
  steps = sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints"))
                 if s.isdigit())
  assert steps, "no final checkpoint after Ctrl-C"
  _INTERRUPT["at"] = -1
  resumed = train(config, workdir, resume=True, progress=False)
  trained = [r["step"] for r in resumed.ppo_metrics]
  # Every step trained exactly once across the two runs (in-flight rollouts were
  # re-generated, not lost and not trained twice).
  assert sorted(trained) == list(range(6))


@pytest.mark.long
@pytest.mark.slow
def test_per_stage_strategies_match_sequential_and_count_weight_sync(tmp_path):
  # per_stage: every stage on all 8 devices, each with its own mesh; weights move between
  # layouts after every update (counted), the mathematics stays the sequential one.
  config = tiny("per_stage")
  config.stages.generate.mesh = dict(data=-1)
  config.stages.infer.mesh = dict(data=4, fsdp=2)
  config.stages.train.mesh = dict(fsdp=-1)
  per_stage = train(config, str(tmp_path / "per_stage"), progress=False).ppo_metrics
  seq = train(tiny("sequential"), str(tmp_path / "seq"), progress=False).ppo_metrics
  assert_same_math(seq, per_stage)
  assert all(r["transfer/actor_sync/bytes"] > 0 for r in per_stage)
  assert all(r["transfer/actor_sync/bytes"] == 0 for r in seq)


def test_mesh_that_does_not_fit_fails_before_training(tmp_path):
  config = tiny("per_stage")
  config.stages.generate.mesh = dict(pipeline=8)  # 2 layers cannot split into 8 stages
  start = time.perf_counter()
  with pytest.raises(ValueError, match=r"stages.generate.mesh.*pipeline=8"):
    train(config, str(tmp_path), progress=False)
  assert not os.path.exists(os.path.join(str(tmp_path), "warmstart"))
  assert time.perf_counter() - start < 60
