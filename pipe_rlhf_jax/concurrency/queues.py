"""Bounded host queues linking stage workers, with shutdown and back-pressure metrics.

Owns: `BoundedQueue` and the shutdown exception family. Every blocking call
waits in short slices so it notices a stop event or `close()` promptly; nothing
in here can block forever once the workers are told to stop. The blocked-time
counters are the back-pressure signal: a producer that spends its time blocked
on a full queue is faster than its consumer, and vice versa.
"""

from __future__ import annotations

import collections
import queue as _queue
import threading
from typing import Any, Iterator

from pipe_rlhf_jax.checks import check_int
from pipe_rlhf_jax.concurrency.waiting import deadline_after, wait_until

DEFAULT_POLL_S = 0.05


class PipelineShutdown(Exception):
  """A wait was abandoned because the workers are shutting down.

  Worker groups treat this family as a clean exit of a worker, not a failure.
  """


class QueueClosed(PipelineShutdown):
  """Raised by `BoundedQueue.put/get` once the queue is closed (and drained) or stop is set."""


def _stop_requested(event: threading.Event | None) -> bool:
  return event is not None and event.is_set()


class BoundedQueue:
  """A FIFO of at most `maxsize` items whose waits can be interrupted.

  Semantics:
    * `put` blocks while full; `get` blocks while empty.
    * Once the stop event is set, blocked and new calls raise `QueueClosed`
      (stop means "halt now", so pending items are not handed out).
    * After `close()` (drain=True), `get` still returns the remaining items and
      then raises `QueueClosed`; `put` raises `QueueClosed` at once. This is
      how a producer signals a clean end of stream.
    * `close(drain=False)` also discards pending items, for aborts.
    * A `timeout` raises `queue.Full` / `queue.Empty` like the stdlib queue.

  Args:
    maxsize: Capacity, >= 1.
    name: Used in error messages and metrics.
    stop_event: Default event observed by every call (a per-call one may be
      passed too; either being set stops the wait).
    poll_s: Longest single wait slice in seconds.
  """

  # Held in this process's memory: a stop aborts it at once (`system/pipe_loop.Stream`).
  in_process = True

  def __init__(
      self,
      maxsize: int,
      name: str = "queue",
      stop_event: threading.Event | None = None,
      poll_s: float = DEFAULT_POLL_S,
  ):
    check_int(maxsize, f"BoundedQueue {name!r}: maxsize")
    if poll_s <= 0:
      raise ValueError(f"BoundedQueue {name!r}: poll_s must be > 0, got {poll_s!r}.")
    self.maxsize = maxsize
    self.name = name
    self.stop_event = stop_event
    self.poll_s = poll_s
    self._items: collections.deque[Any] = collections.deque()
    self._lock = threading.Lock()
    self._not_empty = threading.Condition(self._lock)
    self._not_full = threading.Condition(self._lock)
    self._closed = False
    self._high_water = 0
    self._put_blocked_s = 0.0
    self._get_blocked_s = 0.0
    self._num_put = 0
    self._num_get = 0

  # --- state -----------------------------------------------------------------

  @property
  def closed(self) -> bool:
    """True once `close()` was called."""
    return self._closed

  def qsize(self) -> int:
    """Number of items currently queued."""
    with self._lock:
      return len(self._items)

  @property
  def high_water(self) -> int:
    """Largest queue length observed right after a put."""
    return self._high_water

  @property
  def put_blocked_s(self) -> float:
    """Total seconds producers spent waiting on a full queue."""
    return self._put_blocked_s

  @property
  def get_blocked_s(self) -> float:
    """Total seconds consumers spent waiting on an empty queue."""
    return self._get_blocked_s

  @property
  def num_put(self) -> int:
    """Items successfully put so far."""
    return self._num_put

  @property
  def num_get(self) -> int:
    """Items successfully taken so far."""
    return self._num_get

  def metrics(self) -> dict[str, float]:
    """Snapshot of the back-pressure counters, keyed `queue/<name>/...`."""
    with self._lock:
      p = f"queue/{self.name}"
      return {
          f"{p}/size": float(len(self._items)),
          f"{p}/high_water": float(self._high_water),
          f"{p}/put_blocked_s": self._put_blocked_s,
          f"{p}/get_blocked_s": self._get_blocked_s,
          f"{p}/num_put": float(self._num_put),
          f"{p}/num_get": float(self._num_get),
      }

  # --- operations ------------------------------------------------------------

  def _check_stop(self, stop_event: threading.Event | None, op: str) -> None:
    if _stop_requested(self.stop_event) or _stop_requested(stop_event):
      raise QueueClosed(f"queue {self.name!r}: {op} abandoned, stop requested")

  def put(
      self,
      item: Any,
      timeout: float | None = None,
      stop_event: threading.Event | None = None,
  ) -> None:
    """Appends `item`, waiting while the queue is full.

    Args:
      item: Anything.
      timeout: Seconds to wait at most; None waits until space, close or stop.
      stop_event: Extra event that aborts the wait when set.

    Raises:
      QueueClosed: the queue is closed or stop was requested.
      queue.Full: `timeout` elapsed with the queue still full.
    """
    def has_space() -> bool:
      self._check_stop(stop_event, "put")
      if self._closed:
        raise QueueClosed(f"queue {self.name!r} is closed; cannot put")
      return len(self._items) < self.maxsize

    def count_blocked(seconds: float | None) -> None:
      self._put_blocked_s += seconds or 0.0

    with self._not_full:
      wait_until(self._not_full, has_space, deadline=deadline_after(timeout),
                 poll_s=self.poll_s, on_done=count_blocked,
                 on_timeout=lambda: _queue.Full(
                     f"queue {self.name!r} still full after {timeout}s"))
      self._items.append(item)
      self._num_put += 1
      self._high_water = max(self._high_water, len(self._items))
      self._not_empty.notify()

  def get(
      self,
      timeout: float | None = None,
      stop_event: threading.Event | None = None,
  ) -> Any:
    """Removes and returns the oldest item, waiting while the queue is empty.

    Args:
      timeout: Seconds to wait at most; None waits until an item, close or stop.
      stop_event: Extra event that aborts the wait when set.

    Returns:
      The item.

    Raises:
      QueueClosed: closed and drained, or stop was requested.
      queue.Empty: `timeout` elapsed with the queue still empty.
    """
    def has_item() -> bool:
      self._check_stop(stop_event, "get")
      if self._items:
        return True
      if self._closed:  # closed queues still hand out what they hold
        raise QueueClosed(f"queue {self.name!r} is closed and drained")
      return False

    def count_blocked(seconds: float | None) -> None:
      self._get_blocked_s += seconds or 0.0

    with self._not_empty:
      wait_until(self._not_empty, has_item, deadline=deadline_after(timeout),
                 poll_s=self.poll_s, on_done=count_blocked,
                 on_timeout=lambda: _queue.Empty(
                     f"queue {self.name!r} still empty after {timeout}s"))
      item = self._items.popleft()
      self._num_get += 1
      self._not_full.notify()
      return item

  def close(self, drain: bool = True) -> None:
    """Marks end of stream; idempotent.

    Args:
      drain: If True, consumers may still take the queued items; if False the
        items are discarded so consumers stop at once (abort).
    """
    with self._lock:
      self._closed = True
      if not drain:
        self._items.clear()
      self._not_empty.notify_all()
      self._not_full.notify_all()

  def __iter__(self) -> Iterator[Any]:
    """Yields items until the queue is closed and drained (or stop is set)."""
    while True:
      try:
        yield self.get()
      except QueueClosed:
        return

  def __repr__(self) -> str:
    return (f"BoundedQueue(name={self.name!r}, size={self.qsize()}/{self.maxsize}, "
            f"closed={self._closed})")
