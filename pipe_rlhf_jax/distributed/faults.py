"""Failure in one process of a job stops all of them within seconds, with a named cause.

Owns `FaultWatch`, one per process of a multi-process job. Two kinds of failure:

* an exception: the failing process records "process i (activity): error" under a
  key of the coordination service's key-value store (`report_failure`) and exits
  non-zero (process 0, which hosts that service, first waits until the others have read
  it); every other process polls those keys (`poll_s`), prints the message, and exits
  non-zero as well, even while its main thread is blocked inside a collective that will
  never complete;
* a killed or lost process: it stops sending heartbeats and, `heartbeat_timeout_s` later,
  jax's coordination service aborts every other process itself (its fatal message names
  the task). The watch cannot pre-empt that abort, so each process also records what it
  is doing (`set_activity`: phase, PPO step) and the last one is printed by the launcher
  from the dead process's log.

Nothing here runs on one process: `FaultWatch.start` returns None there.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from pipe_rlhf_jax.distributed import cluster

_PREFIX = "pipe_rlhf_jax/faults"


class FaultWatch:
  """Watches the job for another process's failure and ends this one when it happens.

  Args:
    poll_s: how often the failure keys are read.
    grace_s: how long a failing process 0 waits after reporting until the others have
      read the report (they need its coordination service to read it).
    settle_s: how long a failing process first looks for another's report, of which
      its own error may be the consequence.
  """

  _current: "FaultWatch | None" = None

  def __init__(self, poll_s: float = 0.5, grace_s: float = 2.0, settle_s: float = 1.0):
    self.poll_s = poll_s
    self.grace_s = grace_s
    self.settle_s = settle_s
    self.index = cluster.process_index()
    self.count = cluster.process_count()
    self._client = cluster.key_value_store()
    self._activity = "starting"
    self._done = threading.Event()
    self._thread: threading.Thread | None = None

  @classmethod
  def start(cls, poll_s: float = 0.5, grace_s: float = 2.0) -> "FaultWatch | None":
    """Starts the watch of this process (once); None on a single-process run."""
    if cluster.process_count() == 1:
      return None
    if cls._current is None:
      watch = cls(poll_s, grace_s)
      watch._thread = threading.Thread(target=watch._watch, name="fault-watch",
                                       daemon=True)
      watch._thread.start()
      cls._current = watch
    return cls._current

  @classmethod
  def current(cls) -> "FaultWatch | None":
    return cls._current

  # ---- this process ----------------------------------------------------------------
  def set_activity(self, what: str) -> None:
    """Records what this process is doing (named in failure messages, and published for
    the peers' progress-deadline messages)."""
    self._activity = what
    from pipe_rlhf_jax.distributed.stopping import publish_activity
    publish_activity(what)

  def describe(self) -> str:
    return f"process {self.index} of {self.count} ({self._activity})"

  def report_failure(self, error: BaseException) -> str:
    """Tells the other processes that this one failed with `error`; returns the message."""
    lines = traceback.format_exception_only(type(error), error)
    message = f"{self.describe()} failed: {''.join(lines).strip()}"
    try:
      self._client.key_value_set(f"{_PREFIX}/{self.index}", message, allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except
      pass  # the coordination service is gone already: the heartbeat path stops the job
    return message

  def fail(self, error: BaseException, status: int = 1) -> None:
    """Reports `error`, prints it with its traceback, and ends this process (`status`).

    An error here is often the echo of another process's failure: a collective whose
    peer has exited fails too ("connection closed by peer"), sometimes before the watch
    has read the other's report. So the reports of the others are read first (for at
    most `settle_s`); if one is there, this process stops naming that cause, with its
    own error as the consequence, instead of reporting a failure of its own.

    Process 0 hosts the coordination service, which every other process needs to read
    the report: it waits (at most `grace_s`) until they have; any other process exits
    at once (the others stop on reading its report, long before a heartbeat timeout).
    """
    self._done.set()
    own = "".join(traceback.format_exception_only(type(error), error)).strip()
    causes = self._wait_for_failures(self.settle_s)
    if causes:
      self._ack()
      print(f"[pipe_rlhf_jax] stopping {self.describe()}: " + "; ".join(causes)
            + f" (then here: {own})", file=sys.stderr, flush=True)
    else:
      message = self.report_failure(error)
      traceback.print_exception(error)
      print(f"[pipe_rlhf_jax] {message}; stopping every process.", file=sys.stderr,
            flush=True)
    if self.index == 0:
      # Processes that failed themselves never acknowledge: they are gone already.
      deadline = time.monotonic() + self.grace_s
      while (time.monotonic() < deadline
             and len(self._acks()) + len(causes) < self.count - 1):
        time.sleep(0.05)
    os._exit(status)  # skip atexit: jax's shutdown barrier would wait for the others

  def _wait_for_failures(self, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while True:
      try:
        failures = self._failures()
      except Exception:  # pylint: disable=broad-except
        return []  # the coordination service is gone: nothing more to learn from it
      if failures or time.monotonic() >= deadline:
        return failures
      time.sleep(0.05)

  def _ack(self) -> None:
    try:
      self._client.key_value_set(f"{_PREFIX}_ack/{self.index}", "stopping")
    except Exception:  # pylint: disable=broad-except
      pass

  def _acks(self) -> list:
    try:
      return self._client.key_value_dir_get(f"{_PREFIX}_ack/")
    except Exception:  # pylint: disable=broad-except
      return []

  def finish(self) -> None:
    """Stops watching (a normal end, or a stop every process agreed on: the others are
    finishing too). Waits for the watch thread's last read of the coordination service:
    a read still in flight while the interpreter shuts down (and process 0 takes the
    service down) can abort this process in jax's client instead of exiting cleanly."""
    self._done.set()
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join(timeout=10 * self.poll_s)

  # ---- the others ------------------------------------------------------------------
  def _failures(self) -> list[str]:
    entries = self._client.key_value_dir_get(f"{_PREFIX}/")
    return [value for key, value in entries if key.rsplit("/", 1)[1] != str(self.index)]

  def _watch(self) -> None:
    while not self._done.wait(self.poll_s):
      try:
        failures = self._failures()
      except Exception:  # pylint: disable=broad-except
        # The coordination service is unreachable: process 0 is gone, and jax's own
        # heartbeat check aborts this process within its timeout.
        continue
      if failures and not self._done.is_set():
        self._ack()
        print(f"[pipe_rlhf_jax] stopping {self.describe()}: " + "; ".join(failures),
              file=sys.stderr, flush=True)
        os._exit(1)


def set_activity(what: str) -> None:
  """Records this process's current activity, when a watch runs (multi-process jobs)."""
  watch = FaultWatch.current()
  if watch is not None:
    watch.set_activity(what)
