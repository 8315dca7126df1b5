"""The progress deadline of a PPO run: a step that does not finish in time stops the job.

Owns `ProgressDeadline` (how long a step may take: `plan.progress_timeout_s`, or, at
0, a multiple of the slowest step seen and of the planner's prediction) and `Watchdog`
(a thread that the PPO loop beats at every step boundary and that, when a deadline
passes, names what held the step up and stops the run).

Why a deadline per step: a peer can be alive but stuck (a hung reward server, a stage
whose queue nobody drains, a collective that one process never joins). Its heartbeats
keep flowing, so jax's own failure detection never fires, and every wait downstream of
it is legitimately open-ended. The step boundary is the one place where "no progress"
has a meaning that holds in every mode.

What the watchdog does when the deadline passes (`Watchdog.on_stall` decides, see
`phases.ppo_loop.PPOLoop`): it raises `interrupts.Stalled` in the main thread, whose loop stops
the stage workers (the stuck one is abandoned: it may no longer write metrics or
checkpoints); if the main thread is itself stuck inside a native call and does not
react within `grace_s`, the watchdog reports the failure to the other processes (in a
multi-process job) and ends the process with `interrupts.EXIT_STALLED`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import Callable

from pipe_rlhf_jax.concurrency.interrupts import EXIT_STALLED, Stalled

# Auto deadlines (plan.progress_timeout_s = 0). The first step compiles every program
# of the step (minutes for a large model on an accelerator); later steps repeat them.
FIRST_STEP_FLOOR_S = 1800.0
STEP_FLOOR_S = 300.0
# A later step may take this many times the slowest step seen (or predicted) so far.
STEP_FACTOR = 10.0
# One-off waits of a job (datasets built on process 0, the warm start agreed).
ONE_OFF_FLOOR_S = 3600.0


@dataclasses.dataclass(frozen=True)
class ProgressDeadline:
  """How long a PPO step, and a one-off wait between processes, may take.

  Attributes:
    timeout_s: `plan.progress_timeout_s`; > 0 is the deadline of every step after a
      run's first (which compiles: at least `FIRST_STEP_FLOOR_S`) and of every one-off
      wait; 0 sizes them automatically.
    predicted_step_s: the planner's predicted seconds per step (None: not priced).
  """

  timeout_s: float = 0.0
  predicted_step_s: float | None = None

  def for_step(self, finished: int, slowest_s: float) -> float:
    """The deadline of the next step after `finished` steps of this run, the slowest of
    which took `slowest_s` seconds.

    A run's first step compiles every program of the step, which takes minutes for a
    large model and has nothing to do with the steady step time a user sizes
    `timeout_s` by: it gets at least `FIRST_STEP_FLOOR_S` whatever the setting.
    """
    if finished == 0:
      return max(FIRST_STEP_FLOOR_S, float(self.timeout_s))
    if self.timeout_s:
      return float(self.timeout_s)
    typical = max(self.predicted_step_s or 0.0, slowest_s)
    return max(STEP_FLOOR_S, STEP_FACTOR * typical)

  def one_off(self) -> float:
    """The deadline of a one-off wait (a barrier while one process builds datasets)."""
    return float(self.timeout_s) if self.timeout_s else ONE_OFF_FLOOR_S

  def describe(self) -> str:
    if self.timeout_s:
      return (f"plan.progress_timeout_s={self.timeout_s:g}; a run's first step, which "
              f"compiles, at least {FIRST_STEP_FLOOR_S:.0f} s")
    return (f"plan.progress_timeout_s=0: the first step {FIRST_STEP_FLOOR_S:.0f} s, "
            f"then {STEP_FACTOR:g}x the slowest step, at least {STEP_FLOOR_S:.0f} s")


class Watchdog:
  """Watches the step boundaries of a run from a thread of its own.

  Args:
    deadline: the policy (`ProgressDeadline`).
    describe: what each stage is doing now (called on a stall, for the message).
    on_stall: called once, from the watchdog's thread, with the `Stalled` error; it
      should make the main thread raise it (`SignalHandler.raise_in_main`) and stop the
      workers. Returns whether it could.
    on_exit: called just before the watchdog ends the process itself (a main thread that
      did not react within `grace_s`): report the failure to the other processes.
    grace_s: how long the main thread may take to react to `on_stall`.
    poll_s: how often the deadline is checked.
  """

  def __init__(self, deadline: ProgressDeadline, describe: Callable[[], str],
               on_stall: Callable[[Stalled], bool],
               on_exit: Callable[[Stalled], None] | None = None, *, grace_s: float = 30.0,
               poll_s: float = 0.5):
    self.deadline = deadline
    self.describe = describe
    self.on_stall = on_stall
    self.on_exit = on_exit
    self.grace_s = grace_s
    self.poll_s = poll_s
    self._lock = threading.Lock()
    self._finished = 0
    self._slowest = 0.0
    self._last = time.monotonic()
    self._step: int | None = None
    self._done = threading.Event()
    self._thread: threading.Thread | None = None
    self.stalled: Stalled | None = None

  def start(self, first_step: int) -> "Watchdog":
    self._step = first_step
    self._last = time.monotonic()
    self._thread = threading.Thread(target=self._watch, name="progress-watchdog",
                                    daemon=True)
    self._thread.start()
    return self

  def beat(self, step: int) -> None:
    """PPO step `step` has finished (its metrics and checkpoint are written)."""
    now = time.monotonic()
    with self._lock:
      self._slowest = max(self._slowest, now - self._last)
      self._finished += 1
      self._last = now
      self._step = step + 1

  def stop(self) -> None:
    self._done.set()
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join(timeout=5)

  def current_deadline(self) -> float:
    with self._lock:
      return self.deadline.for_step(self._finished, self._slowest)

  def _watch(self) -> None:
    while not self._done.wait(self.poll_s):
      with self._lock:
        waited = time.monotonic() - self._last
        limit = self.deadline.for_step(self._finished, self._slowest)
        step = self._step
      if waited < limit:
        continue
      self.stalled = Stalled(
          f"PPO step {step} made no progress for {waited:.0f} s "
          f"({self.deadline.describe()}): {self.describe()}. The newest checkpoint on disk "
          "is kept; find what the named stage waits for (its last log lines), then "
          "resume with --resume, or raise plan.progress_timeout_s if the step is "
          "legitimately that slow.")
      reacted = self.on_stall(self.stalled)
      # A main thread stuck in Python raises at once; one inside a native call never
      # sees the error: it gets at most the grace (and no more than the deadline).
      if reacted and self._done.wait(min(self.grace_s, limit)):
        return
      print(f"[pipe_rlhf_jax] {self.stalled} The main thread did not stop within "
            f"{min(self.grace_s, limit):.0f} s (blocked in a native call): ending the "
            "process.",
            file=sys.stderr, flush=True)
      if self.on_exit is not None:
        try:
          self.on_exit(self.stalled)
        except Exception:  # pylint: disable=broad-except
          pass
      os._exit(EXIT_STALLED)  # the main thread cannot be unblocked from here
