"""Versioned policy weights shared between the train and generate workers.

Owns: `VersionedWeights` (a thread-safe "latest published params" slot with
blocking waits) and the staleness rule of asynchronous PPO.

Version convention: version 0 is the initial policy; the train step on rollout
batch k publishes version k + 1. Generating rollout batch k with at most
`max_staleness` policy lag therefore needs a version >= k - max_staleness
(`required_version`). max_staleness = 0 is fully synchronous PPO (batch k waits
for the update from batch k - 1); larger values let generation run ahead of
training by that many batches.
"""

from __future__ import annotations

import threading
from typing import Any

from pipe_rlhf_jax.concurrency.queues import PipelineShutdown
from pipe_rlhf_jax.concurrency.waiting import deadline_after, wait_until

DEFAULT_POLL_S = 0.05


class WeightsClosed(PipelineShutdown):
  """A wait for weights was abandoned because of close() or a stop request."""


def required_version(batch_index: int, max_staleness: int) -> int:
  """Oldest weight version allowed to generate rollout batch `batch_index`.

  Args:
    batch_index: 0-based rollout batch index k.
    max_staleness: How many train steps the generating policy may lag (>= 0).

  Returns:
    max(0, k - max_staleness).

  Raises:
    ValueError: on negative or non-integer arguments.
  """
  if not isinstance(batch_index, int) or batch_index < 0:
    raise ValueError(f"batch_index must be an int >= 0, got {batch_index!r}.")
  if not isinstance(max_staleness, int) or max_staleness < 0:
    raise ValueError(
        f"max_staleness must be an int >= 0, got {max_staleness!r} "
        "(0 = synchronous PPO)."
    )
  return max(0, batch_index - max_staleness)


class VersionedWeights:
  """Thread-safe holder of the latest published params and their version.

  Only the newest params are kept (older ones are released to free memory).

  Args:
    params: Optional initial params (published as `version`).
    version: Version of the initial params (default 0).
    poll_s: Longest single wait slice, so stop events are noticed promptly.
  """

  # Held in this process's memory: publishers hand it params already on the consumer's
  # layout, and a stop closes it (`system/pipe_loop.Weights`).
  in_process = True

  def __init__(self, params: Any = None, version: int = 0,
               poll_s: float = DEFAULT_POLL_S):
    self.poll_s = poll_s
    self._cond = threading.Condition()
    self._params: Any = None
    self._version: int | None = None
    self._closed = False
    self._wait_s = 0.0
    self._max_wait_s = 0.0
    self._num_waits = 0
    self._num_blocked_waits = 0
    if params is not None:
      self.publish(params, version)

  @property
  def version(self) -> int | None:
    """Latest published version, or None before the first publish."""
    return self._version

  def publish(self, params: Any, version: int | None = None) -> int:
    """Makes `params` the latest weights and wakes waiters.

    Args:
      params: Any pytree (typically device arrays on the generate mesh).
      version: New version; must exceed the current one. None means
        current + 1 (or 0 for the first publish).

    Returns:
      The version published.

    Raises:
      ValueError: if `version` does not strictly increase.
      WeightsClosed: if the store was closed.
    """
    with self._cond:
      if self._closed:
        raise WeightsClosed("VersionedWeights is closed; cannot publish")
      if version is None:
        version = 0 if self._version is None else self._version + 1
      if not isinstance(version, int):
        raise ValueError(f"publish: version must be an int, got {version!r}.")
      if self._version is not None and version <= self._version:
        raise ValueError(
            f"publish: versions must strictly increase; got {version} after "
            f"{self._version}."
        )
      self._params, self._version = params, version
      self._cond.notify_all()
      return version

  def latest(self) -> tuple[Any, int]:
    """Returns (params, version) of the newest publish.

    Raises:
      LookupError: nothing was published yet.
    """
    with self._cond:
      if self._version is None:
        raise LookupError("VersionedWeights.latest: nothing published yet.")
      return self._params, self._version

  def wait_for(
      self,
      min_version: int,
      stop_event: threading.Event | None = None,
      timeout: float | None = None,
  ) -> tuple[Any, int]:
    """Blocks until a version >= `min_version` exists, then returns the newest.

    Args:
      min_version: Oldest acceptable version (see `required_version`).
      stop_event: Aborts the wait when set.
      timeout: Seconds to wait at most; None waits until publish/stop/close.

    Returns:
      (params, version) with version >= min_version.

    Raises:
      WeightsClosed: stop_event set or `close()` called before it arrived.
      TimeoutError: `timeout` elapsed first.
    """
    def arrived() -> bool:
      if self._version is not None and self._version >= min_version:
        return True
      if stop_event is not None and stop_event.is_set():
        raise WeightsClosed(f"wait_for(version >= {min_version}) abandoned: stop requested")
      if self._closed:
        raise WeightsClosed(f"wait_for(version >= {min_version}) abandoned: store closed")
      return False

    def count_wait(seconds: float | None) -> None:
      self._num_waits += 1
      self._num_blocked_waits += int(seconds is not None)
      self._wait_s += seconds or 0.0
      self._max_wait_s = max(self._max_wait_s, seconds or 0.0)

    with self._cond:
      wait_until(self._cond, arrived, deadline=deadline_after(timeout), poll_s=self.poll_s,
                 on_done=count_wait,
                 on_timeout=lambda: TimeoutError(
                     f"wait_for(version >= {min_version}) timed out after {timeout}s; "
                     f"latest version is {self._version}."))
      return self._params, self._version

  def close(self) -> None:
    """Wakes all waiters with `WeightsClosed`; publishes are refused after."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()

  def metrics(self) -> dict[str, float]:
    """Waiting statistics: total/max seconds blocked and wait counts."""
    with self._cond:
      return {
          "weights/version": float(-1 if self._version is None else self._version),
          "weights/wait_s": self._wait_s,
          "weights/max_wait_s": self._max_wait_s,
          "weights/num_waits": float(self._num_waits),
          "weights/num_blocked_waits": float(self._num_blocked_waits),
      }


class StalenessGate:
  """Applies the staleness bound when a generator fetches weights.

  Args:
    weights: The shared store, or anything with its `wait_for` (a cross-process
      subscription: `system/pipe_loop.Weights`).
    max_staleness: Allowed policy lag in train steps (>= 0).
  """

  def __init__(self, weights: Any, max_staleness: int):
    required_version(0, max_staleness)  # validates max_staleness
    self.weights = weights
    self.max_staleness = max_staleness
    self._lock = threading.Lock()
    self._lags: dict[int, int] = {}

  def acquire(
      self,
      batch_index: int,
      stop_event: threading.Event | None = None,
      timeout: float | None = None,
  ) -> tuple[Any, int]:
    """Waits for weights allowed for `batch_index` and returns the newest.

    Args:
      batch_index: Rollout batch about to be generated.
      stop_event: Aborts the wait when set.
      timeout: Seconds to wait at most.

    Returns:
      (params, version) with version >= required_version(batch_index, ...).
    """
    params, version = self.weights.wait_for(
        required_version(batch_index, self.max_staleness),
        stop_event=stop_event, timeout=timeout)
    with self._lock:
      # Lag = train steps between the policy used and the one batch k will update.
      self._lags[batch_index] = batch_index - version
    return params, version

  def lags(self) -> dict[int, int]:
    """{batch_index: batch_index - version used}; never above max_staleness."""
    with self._lock:
      return dict(self._lags)
