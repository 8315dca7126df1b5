"""Where the processes of a job agree to stop: one PPO step, the same on every process.

Owns `StepBoundary`, which a schedule consults after every finished step (`reached`) and
its join loop polls (`requested`). A signal may reach one process of a job, or all of
them at different moments; the checkpoint of the step they stop at is written by the
processes together (Orbax saves collectively), so a process that stopped alone would
wait in that save until a barrier timed out. So the decision is taken together:

* the processes that checkpoint (every process in `sequential` / `per_stage`; the
  training group in `pipe` mode across processes: the "voters") each publish, at every
  step boundary, whether they hold a stop request, and read everyone else's vote for
  that step: any request stops all of them after that same step;
* a process that does not vote (a pipe-mode generation or inference process) publishes
  its request under a key the voters read at their next boundary, and learns the
  decided step from a key the first voter writes (`requested`, polled by its join loop).

A vote not cast within the progress deadline names the missing process and its last
recorded activity (`faults.set_activity`), and raises `interrupts.Stalled`.

On one process nothing is published: `reached` and `requested` read the local request.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from pipe_rlhf_jax.concurrency.interrupts import Stalled, StopRequest
from pipe_rlhf_jax.distributed import cluster

_PREFIX = "pipe_rlhf_jax/stop"
_ACTIVITY = "pipe_rlhf_jax/activity"


def publish_activity(what: str) -> None:
  """Records this process's activity where its peers can read it (multi-process jobs)."""
  client = cluster.key_value_store()
  if client is None:
    return
  try:
    client.key_value_set(f"{_ACTIVITY}/{cluster.process_index()}",
                         f"{what} (since {time.strftime('%H:%M:%S')})", allow_overwrite=True)
  except Exception:  # pylint: disable=broad-except
    pass  # the coordination service is gone: the job is ending anyway


def activity_of(process: int) -> str:
  """The last activity process `process` recorded ("unknown" if none or unreachable)."""
  client = cluster.key_value_store()
  if client is None:
    return "unknown"
  try:
    return client.key_value_try_get(f"{_ACTIVITY}/{process}")
  except Exception:  # pylint: disable=broad-except
    return "unknown"


class StepBoundary:
  """The stop decision at PPO step boundaries of one run (see the module docstring).

  Args:
    request: this process's stop request (set by its signal handler).
    voters: the processes that checkpoint and vote (default: all).
    run: a name unique per run of the job (keys never meet another run's).
    timeout_s: the progress deadline, read at each vote (`Watchdog.current_deadline`).
    poll_s: how often a non-voting process reads the decided step.
  """

  def __init__(self, request: StopRequest, *, voters: Sequence[int] | None = None,
               run: str = "ppo", timeout_s: Callable[[], float] = lambda: 600.0,
               poll_s: float = 0.5):
    self.request = request
    self.me = cluster.process_index()
    self.voters = (tuple(range(cluster.process_count())) if voters is None
                   else tuple(sorted(voters)))
    self.run = run
    self.timeout_s = timeout_s
    self.poll_s = poll_s
    self._client = cluster.key_value_store()
    self._published = False
    self._next_poll = 0.0
    self.stop_step: int | None = None  # the step the job agreed to stop after
    self.signum: int | None = None  # the signal that asked for it (here or on a peer)

  @property
  def _key(self) -> str:
    return f"{_PREFIX}/{self.run}"

  def _publish_request(self) -> None:
    if self._client is not None and not self._published and self.request.is_set():
      self._client.key_value_set(f"{self._key}/request/{self.me}",
                                 str(self.request.signum), allow_overwrite=True)
      self._published = True

  def _peer_request(self) -> int:
    """The signal of a non-voting peer's request (0: none)."""
    entries = self._client.key_value_dir_get(f"{self._key}/request/")
    return int(entries[0][1]) if entries else 0

  def reached(self, step: int) -> bool:
    """Step `step` has finished on this (voting) process: whether the job stops here."""
    signum = self.request.signum if self.request.is_set() else 0
    if self._client is not None:
      signum = signum or self._peer_request()
      if len(self.voters) > 1:
        signum = self._vote(step, signum)
      if signum and self.me == self.voters[0]:
        self._client.key_value_set(f"{self._key}/stop_at", f"{step}:{signum}",
                                   allow_overwrite=True)
    if signum:
      self.stop_step, self.signum = step, signum
    return bool(signum)

  def _vote(self, step: int, mine: int) -> int:
    """Every voter's request signal for `step` (0: none); returns the first one set."""
    base = f"{self._key}/vote/{step}"
    self._client.key_value_set(f"{base}/{self.me}", str(mine))
    deadline = time.monotonic() + self.timeout_s()
    stop = mine
    for peer in self.voters:
      if peer == self.me:
        continue
      remaining = max(deadline - time.monotonic(), 0.001)
      try:
        vote = self._client.blocking_key_value_get(f"{base}/{peer}", int(remaining * 1000))
      except Exception as e:  # pylint: disable=broad-except
        raise Stalled(
            f"process {peer} did not finish PPO step {step} within {self.timeout_s():.0f} s "
            f"of process {self.me} (plan.progress_timeout_s); its last activity: "
            f"{activity_of(peer)}. Find why in its log, then resume with --resume.") from e
      stop = stop or int(vote)
    # Everyone has read the votes of two steps ago by now: drop this process's.
    if step >= 2:
      try:
        self._client.key_value_delete(f"{self._key}/vote/{step - 2}/{self.me}")
      except Exception:  # pylint: disable=broad-except
        pass
    return stop

  def requested(self) -> bool:
    """Whether the stage workers of this process should stop now (the join loop's poll).

    One process: its own request. A voter: once the job has agreed on a step. Any other
    process: once the voters have published that step (it publishes its own request
    first, for the voters to see).
    """
    if self._client is None:
      return self.request.is_set()
    self._publish_request()
    if self.me in self.voters:
      return self.stop_step is not None
    now = time.monotonic()
    if now < self._next_poll:
      return False
    self._next_poll = now + self.poll_s
    try:
      value = self._client.key_value_try_get(f"{self._key}/stop_at")
    except Exception:  # pylint: disable=broad-except
      return False  # not there yet (try_get raises NOT_FOUND)
    step, signum = value.split(":")
    self.stop_step, self.signum = int(step), int(signum)
    return True
