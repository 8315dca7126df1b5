"""PPO's loop inside the main job: steps, metrics rows, checkpoints and every way it stops.

Owns `PPOLoop` (the steps [start, end) of a run under a signal handler and a progress
watchdog: a metrics row every `log.every` steps, a checkpoint every `checkpoint.every`,
the stop at a step boundary every checkpointing process agrees on, the final save of a
stalled or interrupted run), `restore_ppo` (a resume's newest checkpoint into the
system), the plan each checkpoint records (`plan_of`) and `WriteFence`, which keeps a
worker the run gave up on from writing while the run closes its files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
from typing import Any

from pipe_rlhf_jax import checkpoint as ckpt_lib
from pipe_rlhf_jax import distributed
from pipe_rlhf_jax import metrics as metrics_lib
from pipe_rlhf_jax.concurrency.interrupts import Interrupted, SignalHandler, Stalled
from pipe_rlhf_jax.concurrency.progress import Watchdog
from pipe_rlhf_jax.concurrency.queues import PipelineShutdown
from pipe_rlhf_jax.concurrency.tracing import Tracer
from pipe_rlhf_jax.config import Plan
from pipe_rlhf_jax.data import digests
from pipe_rlhf_jax.distributed.faults import FaultWatch, set_activity
from pipe_rlhf_jax.distributed.stopping import StepBoundary, activity_of
from pipe_rlhf_jax.metrics import say
from pipe_rlhf_jax.phases.run_state import RunSetup
from pipe_rlhf_jax.stages.rollout_stream import split_data_state
from pipe_rlhf_jax.system import modes
from pipe_rlhf_jax.system.steps import DataFeed
from pipe_rlhf_jax.system.system import PPOSystem

log = logging.getLogger(__name__)

# How long a stalled process, about to end, may spend writing its final checkpoint (a
# tiny state takes a second; a 0.5B-parameter f32 state about ten on a local disk).
STALL_SAVE_TIMEOUT_S = 120


def plan_of(plan: Plan, devices) -> dict[str, Any]:
  """The fields that decide where and in which order PPO runs (not what it computes):
  the typed plan (`Plan`) and the device count, as JSON-able values.

  Stored in each checkpoint so that a resume under another plan can say what changed.
  """
  fields = dataclasses.asdict(plan)
  # Through JSON so that a plan read back from a checkpoint compares equal (tuples).
  return json.loads(json.dumps({"num_devices": len(devices),
                                "num_processes": distributed.process_count(), **fields}))


def restore_ppo(setup: RunSetup, system: PPOSystem, prompts) -> None:
  """Loads the newest PPO checkpoint into `system` and the prompt iterator (on resume).

  The arrays are read straight into the current layouts, whatever mesh wrote them.
  """
  if not setup.start:
    return
  if not setup.role.trains:  # a pipe-mode process without the training stage: no arrays
    meta = setup.checkpointer.read_metadata()
    system.restore({"trainer": None}, meta)
    prompts.set_state(split_data_state(meta["data_state"])[0])
    return
  state, meta = setup.checkpointer.restore(
      target=system.abstract_checkpoint_state(),
      expect_metadata={"config_fingerprint": setup.fingerprint})
  system.restore(state, meta)
  # Partial rollouts also store the prompts they held; `system.restore` took those.
  prompts.set_state(split_data_state(meta["data_state"])[0])
  say(f"resumed PPO at step {setup.start} from {setup.checkpointer.directory}")


def describe_stall(tracer: Tracer) -> str:
  """What held a step up: the stage working longest on its item, or that all wait."""
  me = distributed.process_index()
  where = f" (process {me})" if distributed.process_count() > 1 else ""
  spans = tracer.open_spans()
  if spans:
    stage, batch, seconds, _ = spans[0]
    text = f"the {stage} stage{where} has been working on batch {batch} for {seconds:.0f} s"
    others = [f"{s} on batch {b} for {t:.0f} s" for s, b, t, _ in spans[1:]]
    if others:
      text += f" (also running: {', '.join(others)})"
  else:
    text = (f"no stage{where} is working: each waits for another (a batch or weights "
            "that never came, from this process or a peer)")
  if distributed.process_count() > 1:
    peers = [f"process {p}: {activity_of(p)}" for p in range(distributed.process_count())
             if p != me]
    text += "; the others' last activity: " + "; ".join(peers)
  return text


class WriteFence:
  """Keeps a worker the run has given up on from writing while the run closes its files.

  Every write of a step (metrics row, checkpoint) runs inside `open()`; `close()` waits
  (bounded) for the one in progress, and afterwards `open()` refuses with a clean
  shutdown, so a worker that outlived the shutdown timeout cannot write into a metrics
  file or checkpoint directory that the main thread is closing.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._closed = False

  @contextlib.contextmanager
  def open(self):
    with self._lock:
      if self._closed:
        raise PipelineShutdown("the run has ended: this worker's step is not recorded")
      yield

  def close(self, timeout_s: float = 30.0) -> None:
    got = self._lock.acquire(timeout=timeout_s)
    self._closed = True
    if got:
      self._lock.release()
    else:
      log.warning("A worker kept writing past the end of the run for %.0f s; closing "
                  "the run's files anyway.", timeout_s)


class PPOLoop:
  """PPO steps [setup.start, end): metrics rows, progress, checkpoints, stops.

  A metrics row is written every `log.every` steps and at the last step of the schedule;
  the progress bar and the checkpoints (every `checkpoint.every` steps, at `end`, and on
  a stop) do not depend on it.

  Stops: a SIGINT or SIGTERM (`signals`) during the loop ends it at the next step
  boundary, agreed by every process that checkpoints; the checkpoint of that step is
  written and `Interrupted` raised. A step that makes no progress within the deadline
  (`plan.progress_timeout_s`) raises `Stalled`, naming the stage; the last finished
  step is saved first when the trainer state is whole (the stuck stage is not the
  update) and only this process holds it.

  Its steps, in the order a run meets them: `run` starts the watchdog and the modes'
  loop; `on_step` records each finished step (row, bar, checkpoint, heartbeat); `save`
  writes one checkpoint; on a stall `on_stall` hands the error to the main thread and,
  if the process is about to end, `on_exit` saves what it may; `save_last` is the final
  checkpoint of a stopped run.
  """

  def __init__(self, setup: RunSetup, system: PPOSystem, prompts,
               writer: metrics_lib.MetricsWriter, end: int, progress: bool,
               signals: SignalHandler):
    self.setup, self.system, self.prompts, self.writer = setup, system, prompts, writer
    self.start, self.end, self.progress, self.signals = setup.start, end, progress, signals
    self.settings = setup.experiment.settings
    self.feed = DataFeed(prompts, vocab_size=system.vocab_size)
    self.tracer = Tracer()
    self.bar = metrics_lib.ProgressBar(end - self.start, desc=f"ppo[{system.mode}]",
                                       keys=("reward/mean", "rule_reward/mean", "kl/mean"),
                                       disable=not progress or not setup.role.writes)
    self.plan = plan_of(setup.plan, setup.devices)
    self.fields = ckpt_lib.fingerprinted_fields(digests.with_content(
        self.settings.to_dict(), setup.data_files))
    self.fence = WriteFence()
    # The newest step on disk: a resumed run starts with its checkpoint already written.
    self.last_saved = self.start - 1
    self.stalled_in_update = False
    self.watchdog = Watchdog(setup.deadline, lambda: describe_stall(self.tracer),
                             self.on_stall, self.on_exit)

  def save(self, step: int) -> None:
    """The checkpoint of `step`: the trainer state, the plan and the data position."""
    setup = self.setup
    state = self.system.checkpoint_state()
    if setup.role.across:
      # Orbax refuses device arrays held by one process of a multi-process job; host
      # copies are written by process 0 and restored straight onto the devices.
      state = distributed.fetch(state)
    setup.checkpointer.save(step, state, metadata={
        **self.system.checkpoint_metadata(), "step": step,
        "config_fingerprint": setup.fingerprint, "config": self.fields, "plan": self.plan,
        "data_state": self.feed.state_before(step + 1), "data_files": setup.data_files})

  def on_step(self, step: int, metrics: dict) -> None:
    """A finished step: its metrics row, the bar, a checkpoint when due, a heartbeat."""
    settings, end = self.settings, self.end
    with self.fence.open():
      metrics["data/" + "skipped"] = float(sum(v for k, v in self.prompts.stats().items()
                                               if k.startswith("skipped")))
      if (step + 1) % settings.log.every == 0 or step + 1 == settings.ppo.steps:
        self.writer.write(step, metrics, phase="ppo")
      self.bar.update(metrics)
      set_activity(f"PPO step {step + 1}")
      if not self.progress and (step + 1) % max((end - self.start) // 10, 1) == 0:
        kl = f"kl {metrics['kl/mean']:.4f}, " if "kl/mean" in metrics else ""
        say(f"ppo step {step + 1}/{end}: reward {metrics['reward/mean']:.4f}, {kl}"
            f"{metrics['time/step_s']:.2f}s/step")
      if (step + 1) % settings.checkpoint.every == 0 or step + 1 == end:
        self.save(step)
        self.last_saved = step
      self.watchdog.beat(step)

  def save_last(self, step: int | None) -> None:
    """The checkpoint of `step`, the last one finished, unless it is on disk already."""
    if (self.setup.role.trains and step is not None and step >= 0
        and step != self.last_saved):
      log.warning("Stopping: writing a final checkpoint at PPO step %d", step)
      self.save(step)
      self.last_saved = step
    self.setup.checkpointer.wait()

  def saves_on_stall(self) -> bool:
    """Whether a stall may save: a whole trainer state (not stuck inside an update) that
    only this process holds."""
    alone = distributed.process_count() == 1 or self.setup.role.trains_alone
    return alone and not self.stalled_in_update

  def on_stall(self, error: Stalled) -> bool:
    self.stalled_in_update = any(s[0] == "train" for s in self.tracer.open_spans())
    return self.signals.raise_in_main(error)

  def on_exit(self, error: Stalled) -> None:
    # The main thread is blocked in a native call (a hung reward server, say) and the
    # process is about to end: a whole trainer state that only this process holds is
    # saved from here, within a bound, so that the finished steps are not lost.
    if self.saves_on_stall():
      saver = threading.Thread(target=self.save_last, args=(self.system.version - 1,),
                               name="stall-save", daemon=True)
      saver.start()
      saver.join(timeout=STALL_SAVE_TIMEOUT_S)
      if saver.is_alive():
        log.error("The final checkpoint did not finish within %d s; the newest one on "
                  "disk is kept.", STALL_SAVE_TIMEOUT_S)
    watch = FaultWatch.current()
    if watch is not None:
      watch.report_failure(error)

  def run(self) -> Tracer:
    """Runs the steps; returns the trace. Raises `Interrupted` or `Stalled` on a stop."""
    setup, system, start, end = self.setup, self.system, self.start, self.end
    with self.signals.deferred() as request:
      boundary = StepBoundary(request, voters=setup.role.trainers, run=f"ppo-{start}-{end}",
                              timeout_s=self.watchdog.current_deadline)
      self.watchdog.start(start)
      try:
        stopped = modes.run(system, self.feed, start, end, self.on_step, self.tracer,
                            boundary)
        if stopped or request.is_set():
          last = boundary.stop_step if not setup.role.trains else system.version - 1
          self.save_last(last)
          signum = request.signum or boundary.signum or signal.SIGINT
          raise Interrupted(signum, self.last_saved, agreed=True,
                            where=f"after PPO step {last}" if last is not None else "")
      except Stalled:
        self.watchdog.stop()
        # A whole trainer state (not stuck inside an update) that only this process
        # holds is saved: nothing finished is lost. Otherwise the newest checkpoint stays.
        if self.saves_on_stall():
          self.save_last(system.version - 1)
        raise
      finally:
        self.watchdog.stop()
        self.fence.close()
        self.bar.close()
        setup.checkpointer.wait()
        if self.tracer.spans() and setup.role.writes:
          self.tracer.to_chrome_trace(os.path.join(setup.workdir, "trace.json"))
          self.tracer.gantt(os.path.join(setup.workdir, "gantt.png"),
                            title=f"PPO stages ({system.mode})")
        self.writer.flush()
    return self.tracer
