"""Running environment calls on host threads, in parallel, each bounded by a timeout.

Owns `call_all`: the calls of one turn (one per episode still running) start together,
each on a daemon thread of its own, and are collected until a common deadline. A call
that returns gives its value, one that raises gives its exception, one still running at
the deadline is abandoned: its episode ends as "tool_timeout" and the thread is left to
finish (or hang) on its own, never joined. A thread per call rather than a pool: a pool
whose workers are stuck in hung calls would stall every later call behind them, and a
stage must never wait on a tool past its timeout. Daemon threads do not keep the
process alive at exit.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Sequence

# Outcome kinds, as episode-end reasons name them.
OK, ERROR, TIMEOUT = "ok", "tool_error", "tool_timeout"


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What one call gave.

  Attributes:
    kind: OK, ERROR (it raised) or TIMEOUT (still running at the deadline).
    value: the return value (OK), else None.
    error: "<ExceptionType>: message" (ERROR), else "".
    seconds: how long the call ran (the timeout for a TIMEOUT).
  """

  kind: str
  value: Any = None
  error: str = ""
  seconds: float = 0.0


class _Call(threading.Thread):
  """One call on its own daemon thread; its outcome once finished."""

  def __init__(self, fn: Callable[[], Any], name: str):
    super().__init__(name=name, daemon=True)
    self.fn = fn
    self.outcome: Outcome | None = None

  def run(self):
    start = time.perf_counter()
    try:
      value = self.fn()
    except BaseException as e:  # noqa: BLE001 - any failure of a tool ends its episode only
      self.outcome = Outcome(ERROR, error=f"{type(e).__name__}: {e}",
                             seconds=time.perf_counter() - start)
    else:
      self.outcome = Outcome(OK, value=value, seconds=time.perf_counter() - start)


# Threads abandoned at their deadline that have not finished since (hung tools).
_abandoned: list[_Call] = []
_abandoned_lock = threading.Lock()


def hung_calls() -> int:
  """Abandoned calls still running, in this process (a metric: tools that hang)."""
  with _abandoned_lock:
    _abandoned[:] = [c for c in _abandoned if c.is_alive()]
    return len(_abandoned)


def call_all(fns: Sequence[Callable[[], Any]], timeout_s: float, name: str = "env"
             ) -> list[Outcome]:
  """Runs every call of `fns` at once, each on its own thread, for `timeout_s` at most.

  Args:
    fns: argument-less callables (one per episode).
    timeout_s: the common deadline after the calls start, in seconds.
    name: the threads' name prefix (what a stack dump shows).

  Returns:
    One `Outcome` per call, in order.
  """
  calls = [_Call(fn, f"{name}-{i}") for i, fn in enumerate(fns)]
  for c in calls:
    c.start()
  deadline = time.perf_counter() + timeout_s
  out = []
  for c in calls:
    c.join(max(deadline - time.perf_counter(), 0.0))
    if c.outcome is None:  # still running: abandoned to finish (or hang) on its own
      with _abandoned_lock:
        _abandoned.append(c)
      out.append(Outcome(TIMEOUT, seconds=timeout_s))
    else:
      out.append(c.outcome)
  return out
