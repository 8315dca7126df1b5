"""The one blocking-wait loop of the plan: wait on a condition, in slices, to a deadline.

Owns `wait_until`, used by `BoundedQueue.put/get` and `VersionedWeights.wait_for`. Waits
are cut into `poll_s` slices so that a stop event, which is set without notifying the
condition, is noticed within one slice: nothing in the plan blocks forever once the
workers are told to stop.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


def deadline_after(timeout: float | None) -> float | None:
  """The `time.perf_counter()` value at which a wait of `timeout` seconds gives up."""
  return None if timeout is None else time.perf_counter() + timeout


def wait_until(cond: threading.Condition, ready: Callable[[], bool], *,
               deadline: float | None, poll_s: float,
               on_timeout: Callable[[], BaseException],
               on_done: Callable[[float | None], None] | None = None) -> None:
  """Waits on `cond` (whose lock the caller holds) until `ready()` is true.

  Args:
    cond: the condition that state changes notify.
    ready: checked first and after every wake-up, with the lock held. It may raise to
      abandon the wait (a stop request, a closed queue): that exception propagates.
    deadline: `time.perf_counter()` value to give up at (see `deadline_after`); None
      waits until ready or abandoned.
    poll_s: the longest single wait, i.e. how late a stop event may be noticed.
    on_timeout: builds the exception raised when the deadline passes first.
    on_done: called however the wait ends (ready, abandoned, timed out) with the seconds
      spent blocked, or None when `ready()` was true at once; for back-pressure metrics.
  """
  blocked_since = None
  try:
    while not ready():
      if blocked_since is None:
        blocked_since = time.perf_counter()
      wait = poll_s
      if deadline is not None:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
          raise on_timeout()
        wait = min(wait, remaining)
      cond.wait(wait)
  finally:
    if on_done is not None:
      on_done(None if blocked_since is None else time.perf_counter() - blocked_since)
