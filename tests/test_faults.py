"""Faults a real run meets, on one process: signals, stuck stages, a second run in the
workdir, interrupted checkpoint writes, a resume whose config changed, bad-step counts.

Each ends in a checkpoint that resumes to the uninterrupted run, or in an error that
names the cause. (Several processes: tests/distributed/test_multihost.py; the whole matrix
of faults by mode: experiments/fault_matrix.py.)
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from pipe_rlhf_jax import checkpoint as ckpt_lib
from pipe_rlhf_jax.concurrency.interrupts import EXIT_STALLED, Interrupted, SignalHandler, Stalled
from pipe_rlhf_jax.concurrency.progress import ProgressDeadline, Watchdog
from pipe_rlhf_jax.concurrency.tracing import Tracer
from pipe_rlhf_jax.concurrency.workers import WorkerGroup
from pipe_rlhf_jax.data import rewards
from pipe_rlhf_jax.ppo.registry import REWARD_FUNCTIONS
from pipe_rlhf_jax.system.steps import BadStepGuard
from pipe_rlhf_jax.train import train
from pipe_rlhf_jax.workdir import WorkdirBusy, WorkdirLock
from tests.helpers.configs import tiny_quickstart
from tests.helpers.xla_env import xla_flags

ROOT = os.path.join(os.path.dirname(__file__), "..")
# Metrics that measure wall time or throughput differ run to run by nature.
TIMING = ("time/", "tokens_per_s", "seconds", "bytes_per_second", "blocked_s", "wait_s")

# Where (and when) a test sends a signal to its own process: {point: (signum, call n)}.
_ARMED: dict[str, tuple[int, int]] = {}
_CALLS: dict[str, int] = {}


def _maybe_signal(point: str) -> None:
  if point not in _ARMED:
    return
  _CALLS[point] = _CALLS.get(point, 0) + 1
  signums, at = _ARMED[point]
  if _CALLS[point] == at:
    for signum in signums:
      os.kill(os.getpid(), signum)


@REWARD_FUNCTIONS.register("test_reverse_with_signals")
def _reverse_with_signals(prompts, completions):
  _maybe_signal("infer")
  return rewards.reverse_accuracy(prompts, completions)


def config_for(mode="sequential", steps=4):
  """The tiny quickstart against a rule (no reward model: the fastest whole run)."""
  config = tiny_quickstart(mode)
  config.reward.fn = "test_reverse_with_signals"
  config.ppo.critic_init = "sft"
  config.ppo.steps = steps
  config.checkpoint.every = 100  # only a stop (and the last step) writes one
  if mode == "pipe":
    config.plan.max_staleness = 0
  return config


def ppo_rows(workdir):
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return [{k: v for k, v in r.items() if k != "time" and not any(t in k for t in TIMING)}
          for r in rows if r["phase"] == "ppo"]


def checkpoints(workdir):
  return sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints"))
                if s.isdigit())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The uninterrupted run, per mode: its PPO metric rows."""
  runs = {}

  def get(mode):
    if mode not in runs:
      workdir = str(tmp_path_factory.mktemp(f"uninterrupted_{mode}"))
      train(config_for(mode), workdir, progress=False)
      runs[mode] = ppo_rows(workdir)
    return runs[mode]
  return get


def _patch_point(monkeypatch, point):
  """Sends the armed signal at `point` of a PPO step, in the main thread."""
  from pipe_rlhf_jax.stages.generate import GenerateStage
  from pipe_rlhf_jax.stages.train import TrainStage
  from pipe_rlhf_jax.system import system as system_module
  if point == "generate":
    call = GenerateStage.__call__

    def generate(self, *args, **kwargs):
      _maybe_signal("generate")
      return call(self, *args, **kwargs)
    monkeypatch.setattr(GenerateStage, "__call__", generate)
  elif point == "update":
    update = TrainStage.update

    def dispatched(self, *args, **kwargs):
      out = update(self, *args, **kwargs)  # the old state's buffers are donated now
      _maybe_signal("update")
      return out
    monkeypatch.setattr(TrainStage, "update", dispatched)
  elif point == "fetch":
    fetch = system_module.fetch

    def fetching(tree):
      _maybe_signal("fetch")
      return fetch(tree)
    monkeypatch.setattr(system_module, "fetch", fetching)


def interrupt_and_resume(monkeypatch, tmp_path, point, signums, mode="sequential"):
  """A run that gets `signums` during step 1 at `point`; then its resume. Returns the
  interruption, the checkpoints it left and the resumed metric rows."""
  _patch_point(monkeypatch, point)
  # The point's second call is step 1 (fetch is called by infer and train each step).
  _ARMED.clear()
  _CALLS.clear()
  _ARMED[point] = (signums, 3 if point == "fetch" else 2)
  workdir = str(tmp_path / "run")
  try:
    with pytest.raises(KeyboardInterrupt) as info:
      train(config_for(mode), workdir, progress=False)
  finally:
    _ARMED.clear()
  left = checkpoints(workdir)
  train(config_for(mode), workdir, resume=True, progress=False)
  return info.value, left, ppo_rows(workdir)


def test_sigint_inside_the_update_saves_that_step_and_resumes_to_the_uninterrupted_run(
    monkeypatch, tmp_path, reference):
  # The update has been dispatched (the trainer's buffers donated) but not fetched: a
  # checkpoint written here must not hold an update one ahead of its step.
  stop, left, rows = interrupt_and_resume(monkeypatch, tmp_path, "update", (signal.SIGINT,))
  assert isinstance(stop, Interrupted) and stop.signum == signal.SIGINT
  assert stop.step == 1 and left == [1] and stop.exit_status == 130
  assert rows == reference("sequential")


@pytest.mark.slow
@pytest.mark.parametrize("point,signum", [("generate", signal.SIGTERM),
                                          ("infer", signal.SIGINT),
                                          ("fetch", signal.SIGTERM),
                                          ("update", signal.SIGTERM)])
def test_a_signal_anywhere_in_a_step_resumes_to_the_uninterrupted_run(
    monkeypatch, tmp_path, reference, point, signum):
  stop, left, rows = interrupt_and_resume(monkeypatch, tmp_path, point, (signum,))
  assert isinstance(stop, Interrupted) and stop.signum == signum and left == [1]
  assert rows == reference("sequential")


@pytest.mark.slow
def test_sigterm_in_pipe_mode_resumes_to_the_uninterrupted_run(monkeypatch, tmp_path,
                                                               reference):
  # At staleness 0 pipe mode computes exactly what sequential does; the signal reaches
  # the main thread while the workers run.
  stop, left, rows = interrupt_and_resume(monkeypatch, tmp_path, "infer",
                                          (signal.SIGTERM,), mode="pipe")
  assert isinstance(stop, Interrupted) and stop.signum == signal.SIGTERM
  assert left and left[-1] <= 1
  # The queues count their items since the run's start (a resumed run's start too).
  def math(rows):
    return [{k: v for k, v in r.items() if not k.startswith("queue/")} for r in rows]
  assert math(rows) == math(reference("pipe"))


@pytest.mark.slow
def test_a_second_signal_aborts_without_a_checkpoint(monkeypatch, tmp_path, reference):
  stop, left, rows = interrupt_and_resume(monkeypatch, tmp_path, "generate",
                                          (signal.SIGTERM, signal.SIGINT))
  assert not isinstance(stop, Interrupted) and "aborting" in str(stop)
  assert left == []  # the resume started again from step 0
  assert rows == reference("sequential")


def test_a_signal_outside_the_ppo_loop_stops_at_once(tmp_path):
  with SignalHandler():
    with pytest.raises(Interrupted, match="SIGTERM: stopped") as info:
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(5)  # the handler raises in this thread before the sleep ends
  assert info.value.step is None and info.value.exit_status == 143
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back


# ---- a step that makes no progress ----------------------------------------------------

def test_the_watchdog_names_the_stage_holding_its_batch_and_stops_the_workers():
  tracer = Tracer()
  release = threading.Event()
  group = WorkerGroup(shutdown_timeout=0.5)

  def generate(stop):
    with tracer.span("generate", batch=3):
      release.wait(60)  # a stage that ignores the stop: abandoned after the timeout

  def train_worker(stop):
    stop.wait(60)

  group.add("generate", generate)
  group.add("train", train_worker)
  with SignalHandler() as signals:
    watchdog = Watchdog(ProgressDeadline(timeout_s=1.0),
                        lambda: ", ".join(f"{s} on batch {b}" for s, b, _, _ in
                                          tracer.open_spans()),
                        signals.raise_in_main, poll_s=0.05)
    group.start()
    watchdog.start(first_step=2)
    watchdog.beat(2)  # one step done: the deadline is the setting's (the first compiles)
    try:
      with pytest.raises(Stalled, match="PPO step 3 made no progress.*generate on batch 3"):
        group.join(timeout=60)
    finally:
      watchdog.stop()
      release.set()
  assert group.abandoned.is_set() and "train" not in group.alive()


def test_the_automatic_deadline_grows_with_the_slowest_step():
  auto = ProgressDeadline(timeout_s=0.0, predicted_step_s=2.0)
  assert auto.for_step(0, 0.0) == 1800.0  # the first step compiles
  assert auto.for_step(3, 1.0) == 300.0
  assert auto.for_step(3, 100.0) == 1000.0
  explicit = ProgressDeadline(timeout_s=7.0)
  assert explicit.for_step(1, 50.0) == 7.0
  assert explicit.for_step(0, 0.0) == 1800.0  # the compiling first step is never cut short


_HANG = textwrap.dedent("""
    import os, sys, time
    os.environ["XLA_FLAGS"] = {xla_flags!r}
    sys.path.insert(0, {root!r})
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    from pipe_rlhf_jax.data import rewards
    from pipe_rlhf_jax.ppo.registry import REWARD_FUNCTIONS
    from pipe_rlhf_jax.train import train
    from tests.helpers.configs import tiny_quickstart
    calls = [0]

    @REWARD_FUNCTIONS.register("hangs_at_step_2")
    def hangs(prompts, completions):
      calls[0] += 1
      if calls[0] == 3:
        print("HANGING", flush=True)
        {hang}
      return rewards.reverse_accuracy(prompts, completions)

    config = tiny_quickstart({mode!r})
    config.reward.fn = "hangs_at_step_2"
    config.ppo.critic_init = "sft"
    config.ppo.steps = 4
    config.checkpoint.every = 100  # only a stop writes a checkpoint before the last step
    config.plan.progress_timeout_s = {timeout}
    config.plan.shutdown_timeout_s = 2.0
    from pipe_rlhf_jax.concurrency.interrupts import Stalled
    try:
      train(config, {workdir!r}, progress=False)
    except Stalled as e:
      print("STALLED", e, flush=True)
      sys.exit(e.exit_status)
""")

# Stuck in Python (the handler raises in it) and stuck in a native call (it cannot).
HANGS = {"python": "while True: time.sleep(0.05)",
         "native": "import ctypes; ctypes.CDLL(None).sleep(600)"}


def run_hanging(tmp_path, mode, hang, timeout=10):
  code = _HANG.format(root=ROOT, xla_flags=xla_flags(8), mode=mode, hang=HANGS[hang],
                      timeout=timeout, workdir=str(tmp_path / "run"))
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("mode,hang", [
    # Extended: the pipe case covers a hang in Python, the native case sequential mode.
    pytest.param("sequential", "python", marks=pytest.mark.extended),
    ("sequential", "native"), ("pipe", "python")])
def test_a_stuck_stage_stops_the_run_naming_it(tmp_path, mode, hang):
  out = run_hanging(tmp_path, mode, hang)
  assert "HANGING" in out.stdout, out.stderr[-3000:]
  assert out.returncode == EXIT_STALLED, out.stdout[-2000:] + out.stderr[-3000:]
  text = out.stdout + out.stderr
  assert "PPO step 2 made no progress" in text and "the infer stage" in text
  # The trainer was not the stuck stage: its last whole step is on disk, saved by the
  # main thread (stuck in Python) or by the watchdog's (stuck in a native call).
  assert checkpoints(str(tmp_path / "run")) == [1]


# ---- the workdir, checkpoints, a changed config ---------------------------------------

def test_a_second_run_in_a_locked_workdir_is_refused_naming_the_holder(tmp_path):
  lock = WorkdirLock(str(tmp_path))
  try:
    with pytest.raises(WorkdirBusy, match=rf"in use by process {os.getpid()} on "):
      train(config_for(), str(tmp_path), progress=False)
    assert not os.path.exists(os.path.join(str(tmp_path), "metrics.jsonl"))
  finally:
    lock.release()
  WorkdirLock(str(tmp_path)).release()  # free again


def test_a_dead_holder_leaves_no_lock_behind(tmp_path):
  code = (f"import sys, os; sys.path.insert(0, {ROOT!r}); "
          f"from pipe_rlhf_jax.workdir import WorkdirLock; WorkdirLock({str(tmp_path)!r}); "
          "os.kill(os.getpid(), 9)")
  assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == -9
  WorkdirLock(str(tmp_path)).release()


def test_unfinished_checkpoint_writes_are_removed_on_start(tmp_path):
  root = tmp_path / "checkpoints"
  with ckpt_lib.Checkpointer(root, async_save=False) as ckpt:
    ckpt.save(0, {"w": np.ones(3)}, metadata={})
  partial = root / f"1{ckpt_lib.TMP_SUFFIX}-1733000000"  # what a kill mid-write leaves
  (partial / "state").mkdir(parents=True)
  (partial / "state" / "blob").write_bytes(b"x" * 1000)
  with ckpt_lib.Checkpointer(root) as ckpt:
    assert ckpt.unfinished == [partial.name]
    ckpt.wait()
    assert ckpt.all_steps() == [0]
  assert not partial.exists()


def test_a_refused_resume_names_the_fields_that_changed(tmp_path):
  workdir = str(tmp_path)
  train(config_for(steps=2), workdir, stop_after=1, progress=False)
  changed = config_for(steps=2)
  changed.ppo.kl_coef = 0.25
  changed.sft.learning_rate = 1e-3
  with pytest.raises(ckpt_lib.CheckpointError,
                     match=r"changed: ppo\.kl_coef: 0\.5 -> 0\.25; "
                           r"sft\.learning_rate: 0\.003 -> 0\.001\. "):
    train(changed, workdir, resume=True, progress=False)
  # The bad-step guard's counts travel with the checkpoint, and a resume continues them
  # (a crash-and-resume loop cannot reset ppo.max_bad_steps' count).
  path = os.path.join(workdir, "checkpoints", "0", "metadata", "metadata")
  meta = json.load(open(path))
  assert meta["bad_steps"] == {"streak": 0, "total": 0}
  meta["bad_steps"] = {"streak": 0, "total": 5}
  json.dump(meta, open(path, "w"))
  train(config_for(steps=2), workdir, resume=True, progress=False)
  assert [r["bad_steps_total"] for r in ppo_rows(workdir)] == [0.0, 5.0]


def test_the_bad_step_guard_continues_across_a_checkpoint():
  guard = BadStepGuard(limit=3)
  for step in range(2):
    guard.check(step, {"bad_updates": 1.0})
  resumed = BadStepGuard(limit=3)
  resumed.restore(json.loads(json.dumps(guard.state())))
  with pytest.raises(FloatingPointError, match="3 consecutive steps"):
    resumed.check(2, {"bad_updates": 1.0})



# Extended: the faults it injects are each held by a test of their own above; this runs
# the experiment script that tabulates them.
@pytest.mark.long
@pytest.mark.slow
@pytest.mark.extended
def test_the_fault_matrix_experiment_writes_its_row(tmp_path):
  # One case of experiments/fault_matrix.py (the critic-free job: no warm start to
  # train), into a scratch directory: the published page's machinery stays working.
  out = subprocess.run([sys.executable, "-m", "experiments.fault_matrix",
                        "--only", "arith:sequential:sigterm@train", "--out-dir",
                        str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=ROOT)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  row = json.loads(open(tmp_path / "cases.jsonl").read().splitlines()[0])
  assert row["clean"] and row["equal"] and row["lost"] == 0 and row["status"] == 143
  page = open(tmp_path / "fault_matrix.md").read()
  assert "| command |" in page and "matmul peak" in page and "sigterm in train" in page
