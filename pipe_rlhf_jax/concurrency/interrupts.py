"""Signals that end a run (Ctrl-C, preemption) and the stop request they turn into.

Owns `SignalHandler` (SIGINT and SIGTERM for the lifetime of a run), `StopRequest` (the
flag a signal, a stalled step or a peer process sets, read at step boundaries),
`Interrupted` / `Stalled` (what a run raises once it has stopped) and the exit statuses.

Two regimes, because a signal can only be honoured safely where the state is whole:

* outside a PPO loop (data build, warm start, held-out evaluation, export) a signal
  raises `Interrupted` at once: the warm start is checkpointed only when both of its
  phases end, and PPO's last step is already on disk, so nothing finished is lost;
* inside one (`SignalHandler.deferred()`), the first signal only sets the request: the
  loop finishes the step it is in (a PPO update is never cut in half: its buffers are
  donated), writes a checkpoint of that step and raises `Interrupted`. A second signal
  raises `KeyboardInterrupt` at once: an abort, after which the newest checkpoint on
  disk is the newest whole step written before it.

A process stopped by signal s exits with status 128 + s (130 for SIGINT, 143 for SIGTERM),
the shell's convention, after its final checkpoint is on disk; a run whose step made no
progress within `plan.progress_timeout_s` exits with `EXIT_STALLED` (124, as
`timeout(1)` does).

Handlers can only be installed from the main thread; elsewhere (a run started from a
worker thread) `SignalHandler` installs nothing and signals keep their previous meaning.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterator

# A step that made no progress within the deadline (timeout(1)'s status).
EXIT_STALLED = 124

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signal_name(signum: int) -> str:
  try:
    return signal.Signals(signum).name
  except ValueError:
    return f"signal {signum}"


def exit_status(signum: int) -> int:
  """The status a process stopped by `signum` exits with (128 + signum)."""
  return 128 + int(signum)


class Interrupted(KeyboardInterrupt):
  """The run stopped on a signal, after writing the checkpoint of its last whole step.

  A `KeyboardInterrupt`, so that `except Exception` handlers treat it as Ctrl-C is
  treated, whichever signal it was.

  Attributes:
    signum: the signal (SIGINT, SIGTERM).
    step: the last PPO step whose checkpoint is on disk (None: the stop came before PPO,
      or before its first step).
    agreed: every process of a multi-process job stopped at this same step (False: this
      process stopped alone, e.g. on a signal outside the PPO loop).
  """

  def __init__(self, signum: int, step: int | None = None, *, where: str = "",
               agreed: bool = False):
    self.signum = int(signum)
    self.step = step
    self.agreed = agreed
    saved = (f"the checkpoint of PPO step {step} is on disk" if step is not None
             else "no PPO step had finished since the newest checkpoint")
    super().__init__(f"{signal_name(signum)}: stopped{' ' + where if where else ''}; "
                     f"{saved}. Continue with --resume (train(..., resume=True)).")

  @property
  def exit_status(self) -> int:
    return exit_status(self.signum)


class Stalled(RuntimeError):
  """A PPO step made no progress within `plan.progress_timeout_s`.

  The message names the stage (and the process) that held the step up.
  """

  exit_status = EXIT_STALLED


class StopRequest:
  """A request to stop at the next step boundary: who asked, and with which signal.

  Thread-safe; the first request wins (later ones only count as "again").
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._event = threading.Event()
    self.signum: int | None = None
    self.source = ""

  def set(self, signum: int, source: str) -> bool:
    """Records the request; returns False when one was already pending."""
    with self._lock:
      if self._event.is_set():
        return False
      self.signum, self.source = int(signum), source
      self._event.set()
      return True

  def is_set(self) -> bool:
    return self._event.is_set()

  def wait(self, timeout: float) -> bool:
    return self._event.wait(timeout)


class SignalHandler:
  """SIGINT / SIGTERM for one run: raise at once, or (`deferred()`) stop at a boundary.

  Use as a context manager around the whole run (`with SignalHandler() as signals:`);
  the previous handlers come back on exit. `request` is the run's `StopRequest`, which
  other parts (the progress watchdog, a peer's request) may set as well.
  """

  def __init__(self, signals: tuple[int, ...] = SIGNALS):
    self.signals = signals
    self.request = StopRequest()
    self._deferring = 0
    self._previous: dict[int, object] = {}
    self._pending: BaseException | None = None
    self._lock = threading.Lock()

  @property
  def installed(self) -> bool:
    return bool(self._previous)

  def __enter__(self) -> "SignalHandler":
    if threading.current_thread() is threading.main_thread():
      for s in self.signals:
        self._previous[s] = signal.getsignal(s)
        signal.signal(s, self._on_signal)
    return self

  def __exit__(self, *exc) -> None:
    for s, previous in self._previous.items():
      signal.signal(s, previous)
    self._previous.clear()

  @contextlib.contextmanager
  def deferred(self) -> Iterator[StopRequest]:
    """Within: the first signal sets `request`; the loop stops at its next boundary."""
    with self._lock:
      self._deferring += 1
    try:
      yield self.request
    finally:
      with self._lock:
        self._deferring -= 1

  def raise_in_main(self, error: BaseException) -> bool:
    """Raises `error` in the main thread at its next Python instruction (from another
    thread: the progress watchdog). Returns False when no handler is installed to do it.

    A main thread blocked inside a native call (a device program, a socket) sees it only
    when that call returns.
    """
    if not self.installed:
      return False
    import _thread
    with self._lock:
      self._pending = error
    _thread.interrupt_main(signal.SIGINT)
    return True

  def _on_signal(self, signum: int, frame) -> None:
    del frame
    with self._lock:
      pending, self._pending = self._pending, None
      deferring = self._deferring > 0
    if pending is not None:
      raise pending
    if not deferring:
      raise Interrupted(signum)
    if not self.request.set(signum, signal_name(signum)):
      raise KeyboardInterrupt(
          f"{signal_name(signum)} again: aborting without a final checkpoint; the newest "
          "checkpoint on disk is the newest whole step written before.")
    print(f"[pipe_rlhf_jax] {signal_name(signum)}: finishing the current PPO step, then "
          "writing its checkpoint and stopping (the same signal again aborts at once)",
          file=sys.stderr, flush=True)
