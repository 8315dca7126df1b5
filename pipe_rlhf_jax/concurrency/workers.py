"""Thread group running stage loops concurrently with fail-fast, bounded shutdown.

Owns: `WorkerGroup`. Each stage (generate / infer / train) runs as one thread
executing `fn(stop_event)`. The group guarantees three things the async PPO
plan relies on:

  * Fail fast: the first exception in any worker sets the shared stop event,
    aborts registered queues / weight stores, and `join()` re-raises that same
    exception object (traceback intact, with a note naming the worker).
  * Stop on request: `join(should_stop=...)` polls a predicate (a signal's stop
    request, agreed with the other processes); when it turns true the workers stop
    after their current item and `join` returns False with `stopped` set. A
    KeyboardInterrupt in the joining thread (an abort) stops them the same way and
    re-raises.
  * Never hang: every wait has a deadline; a worker that ignores the stop
    request for `shutdown_timeout` seconds turns into a RuntimeError naming it
    (and the failure that started the shutdown); the group then abandons it
    (`abandoned` is set), and an error it raises later is printed, not lost.

Shutdown exceptions (`PipelineShutdown`, e.g. `QueueClosed`) escaping a worker
are a clean exit, not a failure: they are how a blocked worker learns to stop.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Any, Callable

from pipe_rlhf_jax.concurrency.queues import BoundedQueue, PipelineShutdown

DEFAULT_POLL_S = 0.05

WorkerFn = Callable[[threading.Event], Any]


class WorkerGroup:
  """Runs named stage loops in threads sharing one stop event.

  Usage:
    group = WorkerGroup(shutdown_timeout=30)
    q = group.register_queue(BoundedQueue(2, "rollouts"))
    group.add("generate", generate_loop)   # generate_loop(stop_event)
    group.add("train", train_loop)
    group.start()
    group.join()

  Args:
    stop_event: Shared event; a new one is created if None.
    shutdown_timeout: Seconds workers get to exit after stop is requested.
    poll_s: Wait slice of the join loop (how fast interrupts are noticed).
    daemon: Run workers as daemon threads so a stuck one cannot keep the
      process alive.
  """

  def __init__(
      self,
      stop_event: threading.Event | None = None,
      *,
      shutdown_timeout: float = 10.0,
      poll_s: float = DEFAULT_POLL_S,
      daemon: bool = True,
  ):
    if shutdown_timeout <= 0:
      raise ValueError(f"shutdown_timeout must be > 0 seconds, got {shutdown_timeout!r}.")
    self.stop_event = stop_event if stop_event is not None else threading.Event()
    self.shutdown_timeout = shutdown_timeout
    self.poll_s = poll_s
    self.daemon = daemon
    self._fns: dict[str, WorkerFn] = {}
    self._threads: dict[str, threading.Thread] = {}
    self._closeables: list[Any] = []
    self._cond = threading.Condition()
    self._finished: set[str] = set()
    self._errors: list[tuple[str, BaseException]] = []
    self._started = False
    self.stopped = False  # join returned because `should_stop` asked
    # Set when the group gives up on workers that ignored a stop request: whatever they
    # do afterwards, nobody waits for it (see `PPOLoop`'s write fence).
    self.abandoned = threading.Event()

  # --- setup -----------------------------------------------------------------

  def add(self, name: str, fn: WorkerFn) -> None:
    """Registers stage loop `fn(stop_event)` under a unique `name`.

    Raises:
      ValueError: duplicate/empty name or non-callable fn.
      RuntimeError: the group was already started.
    """
    if self._started:
      raise RuntimeError(f"WorkerGroup.add({name!r}): group already started.")
    if not name or name in self._fns:
      raise ValueError(f"WorkerGroup.add: worker name {name!r} is empty or already used.")
    if not callable(fn):
      raise ValueError(f"WorkerGroup.add({name!r}): fn must be callable, got {fn!r}.")
    self._fns[name] = fn

  def register_queue(self, q: Any) -> Any:
    """Registers a queue (or anything with `close()`) to abort on stop.

    A `BoundedQueue` is closed with drain=False so blocked peers wake at once;
    other objects (e.g. `VersionedWeights`) get `close()`.

    Returns:
      `q`, for chaining.
    """
    if not callable(getattr(q, "close", None)):
      raise ValueError(f"register_queue: {q!r} has no close() method.")
    self._closeables.append(q)
    return q

  # --- lifecycle -------------------------------------------------------------

  def start(self) -> None:
    """Starts one thread per worker (thread name = worker name)."""
    if self._started:
      raise RuntimeError("WorkerGroup.start: already started.")
    if not self._fns:
      raise ValueError("WorkerGroup.start: no workers added; call add(name, fn) first.")
    self._started = True
    for name, fn in self._fns.items():
      t = threading.Thread(target=self._run, args=(name, fn), name=name,
                           daemon=self.daemon)
      self._threads[name] = t
      t.start()

  def _run(self, name: str, fn: WorkerFn) -> None:
    try:
      fn(self.stop_event)
    except PipelineShutdown:
      pass  # The worker was told to stop while waiting: a clean exit.
    except BaseException as e:  # pylint: disable=broad-except
      e.add_note(f"raised in worker {name!r}")
      if self.abandoned.is_set():
        # Nobody joins this worker any more: say what it died of.
        print(f"[pipe_rlhf_jax] worker {name!r}, abandoned after the shutdown timeout, "
              f"failed later:", file=sys.stderr, flush=True)
        traceback.print_exception(e)
      with self._cond:
        self._errors.append((name, e))
      self.stop()
    finally:
      with self._cond:
        self._finished.add(name)
        self._cond.notify_all()

  def stop(self) -> None:
    """Requests shutdown: sets the stop event and aborts registered queues. Idempotent."""
    self.stop_event.set()
    for c in self._closeables:
      if isinstance(c, BoundedQueue):
        c.close(drain=False)
      else:
        c.close()

  def alive(self) -> list[str]:
    """Names of workers whose threads are still running."""
    return [n for n, t in self._threads.items() if t.is_alive()]

  @property
  def errors(self) -> list[tuple[str, BaseException]]:
    """(worker name, exception) for every failed worker, first failure first."""
    with self._cond:
      return list(self._errors)

  def _wait_stopped(self, timeout: float) -> list[str]:
    """Joins all threads until `timeout`; returns the names still alive."""
    deadline = time.perf_counter() + timeout
    for t in self._threads.values():
      t.join(max(0.0, deadline - time.perf_counter()))
    return self.alive()

  def _stuck_error(self, stuck: list[str], why: str) -> RuntimeError:
    self.abandoned.set()
    return RuntimeError(
        f"WorkerGroup: worker(s) {', '.join(repr(s) for s in stuck)} did not stop "
        f"within shutdown_timeout={self.shutdown_timeout}s after {why}; they must "
        "check stop_event or block only in BoundedQueue/VersionedWeights waits. "
        "They were abandoned: they may no longer write metrics or checkpoints."
    )

  def join(self, timeout: float | None = None, stop_on_timeout: bool = True,
           should_stop: Callable[[], bool] | None = None) -> bool:
    """Waits for all workers; propagates the first worker failure.

    Args:
      timeout: Seconds to wait at most; None waits until all workers finish.
      stop_on_timeout: On timeout, stop the group and raise TimeoutError (True)
        or just return False and keep the workers running (False, for polling).
      should_stop: Polled every `poll_s`; once it returns True the group is stopped
        (each worker finishes its current item) and join returns False with
        `stopped` set.

    Returns:
      True when every worker finished without error.

    Raises:
      BaseException: the original exception of the first failing worker.
      KeyboardInterrupt: after stopping the workers.
      TimeoutError: `timeout` elapsed (stop_on_timeout=True).
      RuntimeError: a worker did not stop within `shutdown_timeout` after a
        failure, stop request, interrupt or timeout.
    """
    if not self._started:
      raise RuntimeError("WorkerGroup.join: call start() first.")
    deadline = None if timeout is None else time.perf_counter() + timeout
    try:
      while True:
        if should_stop is not None and should_stop():
          self.stopped = True
          self.stop()
          break
        with self._cond:
          if self._errors:
            break
          if len(self._finished) == len(self._threads):
            break
          wait = self.poll_s
          if deadline is not None:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
              break
            wait = min(wait, remaining)
          self._cond.wait(wait)
    except BaseException as interrupt:  # Ctrl-C, or an error raised into this thread
      self.stop()
      stuck = self._wait_stopped(self.shutdown_timeout)
      if stuck and isinstance(interrupt, KeyboardInterrupt):
        raise self._stuck_error(stuck, "KeyboardInterrupt") from interrupt
      if stuck:
        # The error names the cause (e.g. a stalled stage): keep it, say who stayed.
        interrupt.add_note(str(self._stuck_error(stuck, type(interrupt).__name__)))
      for name, err in self.errors:
        interrupt.add_note(f"worker {name!r} also failed during shutdown: {err!r}")
      raise

    if self.stopped:
      stuck = self._wait_stopped(self.shutdown_timeout)
      errors = self.errors
      if stuck:
        raise self._stuck_error(stuck, "a stop request") from (errors[0][1] if errors
                                                              else None)
      if errors:
        raise errors[0][1]
      return False

    errors = self.errors
    if errors:
      name, err = errors[0]
      stuck = self._wait_stopped(self.shutdown_timeout)
      if stuck:
        raise self._stuck_error(
            stuck, f"worker {name!r} failed ({type(err).__name__}: {err})") from err
      raise err

    with self._cond:
      running = [n for n in self._threads if n not in self._finished]
    if not running:
      # Every worker left its loop; reap the threads (they are in their last lines).
      self._wait_stopped(self.shutdown_timeout)
      return True
    if not stop_on_timeout:
      return False
    self.stop()
    stuck = self._wait_stopped(self.shutdown_timeout)
    if stuck:
      raise self._stuck_error(stuck, f"join timeout of {timeout}s")
    raise TimeoutError(
        f"WorkerGroup.join: worker(s) {running} still running after {timeout}s; "
        "the group was stopped."
    )

  def run(self, timeout: float | None = None) -> bool:
    """start() then join(timeout)."""
    self.start()
    return self.join(timeout)

  def __enter__(self) -> "WorkerGroup":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    # Leaving the block always ends the workers, so none outlive their owner.
    if not self._started:
      return
    self.stop()
    stuck = self._wait_stopped(self.shutdown_timeout)
    if stuck and exc is None:
      raise self._stuck_error(stuck, "leaving the WorkerGroup context")
