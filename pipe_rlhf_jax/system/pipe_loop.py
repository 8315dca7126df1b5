"""`pipe` mode's three workers, written once over a small channel interface.

Owns the generate -> infer -> train workers (what each stage does per item, the staleness
wait, the step callback, publishing versioned weights, the trace spans, stopping on an
error or a request) and the interface they run over, `PipeChannels`:

  generate --rollouts (Stream)--> infer --experience (Stream)--> train
  train --actor (Weights)--> generate        train --critic (Weights)--> infer

A `Stream` carries (step, pytree, metrics) items in order with back-pressure: `put`,
`get` (each with a timeout and a stop event), `close` (the end of the stream) and
`metrics`. A `Weights` channel holds the newest published (params, version): `publish`,
and `wait_for(min_version)` returning the newest once it is at least `min_version`.
`modes.run_pipe` (one process) links the workers with `BoundedQueue`s and
`VersionedWeights`; `pipe_processes` (stages in different processes) with links through
`distributed.transfer` where two stages live in different groups of processes, and the
same in-process ones where they share a process. The loop itself never asks which.

Where the two cases do differ, on purpose, the difference is a property of the channels:
`in_process` (a channel, see `Stream` / `Weights`), and `sync_in_step`, `span_args`,
`carry_data_state` and `kl_coefs` (the run, see `PipeChannels`).

Version convention and staleness: `concurrency/weights.py`. Checkpoints, metrics and the
bad-step guard: `system/steps.py`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Protocol

from pipe_rlhf_jax.concurrency.queues import PipelineShutdown
from pipe_rlhf_jax.concurrency.tracing import Tracer
from pipe_rlhf_jax.concurrency.weights import StalenessGate
from pipe_rlhf_jax.concurrency.workers import WorkerGroup
from pipe_rlhf_jax.config import STAGES
from pipe_rlhf_jax.distributed.stopping import StepBoundary
from pipe_rlhf_jax.system.steps import DataFeed, OnStep, StopHere, finish_step

# Keys of what travels with a batch's metrics from its generation to its update, where
# they are taken out again: the wall clock when its generation began (the step time is
# taken in the trainer's thread, possibly in another process), and the prompt source's
# state before the next batch (see `PipeChannels.carry_data_state`).
GENERATE_START = "time/generate_start"
DATA_STATE = "_data_state"


class Stream(Protocol):
  """An ordered stream of (step, pytree, metrics) items from one stage to the next.

  Implementations: `concurrency.queues.BoundedQueue` (in one process) and
  `pipe_processes._Link` (between two groups of processes).
  """

  # True for a queue in this process's memory, which a stop aborts at once (the worker
  # group closes it without draining). False for a link to another process: it sees a
  # stop through the event given to put / get, and is never closed on one, because a
  # close tells the consumer in the other process that the run's items are all sent.
  in_process: bool

  def put(self, item: Any, timeout: float | None = None,
          stop_event: threading.Event | None = None) -> None:
    """Sends `item`, waiting while the stream holds its capacity of items in flight."""

  def get(self, timeout: float | None = None,
          stop_event: threading.Event | None = None) -> Any:
    """The next item; raises a `PipelineShutdown` after the last one of a closed stream,
    or once `stop_event` is set."""

  def close(self) -> None:
    """Marks the end of the stream (the consumer still receives what was sent)."""

  def metrics(self) -> dict[str, float]:
    """Back-pressure counters to report with each step (none for a cross-process link)."""


class Weights(Protocol):
  """The newest published version of the actor or the critic, from the trainer to a stage.

  Implementations: `concurrency.weights.VersionedWeights` (in one process) and
  `pipe_processes._Weights` (between two groups of processes).
  """

  # True when the consuming stage is in this process: `publish` takes the params already
  # on its layout (the trainer reshards them, `PPOSystem.actor_for_generation`), and a
  # stop closes the channel to wake its waiters. False: `publish` takes the trainer's own
  # arrays and lays out each receiving process's block itself.
  in_process: bool

  def publish(self, params: Any, version: int) -> Any:
    """Makes `params` the newest weights; versions strictly increase."""

  def wait_for(self, min_version: int, stop_event: threading.Event | None = None,
               timeout: float | None = None) -> tuple[Any, int]:
    """(params, version) of the newest version, once one >= `min_version` is published."""


class KLCoefficients(Protocol):
  """The KL coefficient of each policy version, for an inference stage in another process
  than the trainer (which fixes it when it publishes the version)."""

  def share(self, version: int, coef: float) -> None:
    """Makes `coef` the coefficient of `version` (before that version is published)."""

  def wait(self, version: int, stop: threading.Event) -> float:
    """The coefficient of `version`, waiting until it is shared."""


@dataclasses.dataclass(frozen=True)
class PipeChannels:
  """The channels of one `pipe` run as this process sees them, and how the run uses them.

  Attributes:
    rollouts: generate -> infer, items (step, Rollout, metrics).
    experience: infer -> train, items (step, Experience, metrics).
    actor: the policy's weights, train -> generate.
    critic: the critic's weights, train -> infer; None without a critic (critic-free
      advantage estimators), when nothing of one is synced or published.
    stages: the stages whose workers run in this process.
    sync_in_step: True in one process: the trainer reshards the new weights onto the
      consumers' layouts inside the step, before the step is recorded, so its metrics
      hold the reshards' bytes and seconds (`transfer/actor_sync`, `transfer/critic_sync`)
      and only the publishing follows the record. False across processes: the whole sync
      (reshards for in-process consumers, layouts and offers for the others) follows the
      record, in the `sync` span, and no transfer metrics are reported. Either way a
      trained step is recorded before any publish, which fails once a shutdown has begun.
    span_args: extra annotations of every span (across processes: which process ran it).
    carry_data_state: the prompt source's state before the next batch travels with each
      batch to the trainer, which remembers it for its checkpoint; needed when the
      prompts may be read in another process than the trainer's (across processes).
    kl_coefs: how an inference stage in another process learns each policy version's KL
      coefficient; None in one process, where `PPOSystem.kl_coefs` is shared.
  """

  rollouts: Stream
  experience: Stream
  actor: Weights
  critic: Weights | None
  stages: tuple[str, ...] = STAGES
  sync_in_step: bool = True
  span_args: dict[str, Any] = dataclasses.field(default_factory=dict)
  carry_data_state: bool = False
  kl_coefs: KLCoefficients | None = None

  def weights(self) -> dict[str, Weights]:
    """The weights channels by name, the critic first: an on-policy generator released by
    the actor's version must find the matching critic when its batch reaches inference."""
    out = {"critic": self.critic} if self.critic is not None else {}
    return {**out, "actor": self.actor}

  def in_process_channels(self) -> list[Any]:
    """The channels a stop aborts: those held in this process's memory."""
    return [c for c in (self.rollouts, self.experience, *self.weights().values())
            if c.in_process]


def _received(stream: Stream, stop: threading.Event):
  """The items of `stream` until its producer closes it.

  A shutdown seen while `stop` is set is re-raised (a clean exit of the worker) rather
  than taken for the end of the stream: the worker must not then close its own output,
  which a consumer in another process would read as the end of the run.
  """
  while True:
    try:
      item = stream.get(stop_event=stop)
    except PipelineShutdown:
      if stop.is_set():
        raise
      return
    yield item


def _new_weights(system, channels: PipeChannels) -> dict[str, tuple[Any, Any]]:
  """{name: (params to publish, transfer stats or None)} of the trainer's current state:
  resharded for an in-process consumer, the trainer's own arrays for a link to another
  process (which lays them out for each receiving process itself)."""
  move = {"actor": system.actor_for_generation, "critic": system.critic_for_inference}
  return {name: move[name]() if link.in_process else (getattr(system.state, name), None)
          for name, link in channels.weights().items()}


def _publish(system, channels: PipeChannels, new: dict[str, tuple[Any, Any]],
             version: int) -> None:
  """Publishes `_new_weights` as `version`, the KL coefficient of `version` before them."""
  if channels.kl_coefs is not None:
    channels.kl_coefs.share(version, system.kl_coefs[version])
  for name, link in channels.weights().items():
    link.publish(new[name][0], version)


def run_pipe_workers(system, feed: DataFeed, start: int, end: int, on_step: OnStep,
                     tracer: Tracer, boundary: StepBoundary, channels: PipeChannels,
                     timeout: float | None = None) -> bool:
  """PPO steps [start, end): this process's workers (`channels.stages`) over `channels`.

  Generation of batch k waits until the actor has at least version k - max_staleness
  (0 = on-policy, which reproduces the serial schedule). The training worker calls
  `on_step(step, metrics)` after each update, then stops at `boundary` or publishes the
  new version. The first exception in any worker stops every worker and is re-raised
  here; `boundary.requested()` is polled so that workers blocked in a wait leave at once.

  Args:
    timeout: seconds to wait for the workers at most (None: no bound).

  Returns:
    True when the run stopped on a request.
  """
  cfg = system.plan
  span_args = channels.span_args
  gate = StalenessGate(channels.actor, cfg.max_staleness)
  # A worker is only stopped between items, and an item can be a first call that is
  # still compiling: the bound is generous, but it is a bound (shutdown never hangs).
  group = WorkerGroup(shutdown_timeout=cfg.shutdown_timeout_s)
  for channel in channels.in_process_channels():
    group.register_queue(channel)

  def generate_worker(stop: threading.Event) -> None:
    # Partial rollouts: one engine for the whole run; a batch is the first B completions
    # to finish, the rest keep decoding, and every engine call takes the newest weights
    # the bound allows.
    stream = system.rollout_stream() if cfg.partial_rollouts else None
    for step in range(start, end):
      batch = feed.next(step) if stream is None else None
      waited = time.perf_counter()
      params, version = gate.acquire(step, stop_event=stop)
      began, began_wall = time.perf_counter(), time.time()
      with tracer.span("generate", batch=step, version=version, **span_args):
        if stream is None:
          rollout, metrics = system.generate(params, batch, step, version)
        else:
          rollout, metrics = stream.next_batch(
              step, feed, lambda v: channels.actor.wait_for(v, stop_event=stop))
          # The batch's newest tokens name its policy (KL coefficient, critic version);
          # `version/oldest_token` bounds its staleness.
          version = int(metrics["version/newest_token"])
      if stream is None:
        system.trace_generation(tracer, step)
      metrics["generate_version"] = version
      metrics["time/weights_wait_s"] = began - waited
      # Wall clock: the step time is taken in the trainer's thread (or process).
      metrics[GENERATE_START] = began_wall
      if stream is not None:
        # The prompts held in flight travel with the batch to the trainer's checkpoint.
        metrics[DATA_STATE] = stream.data_state(feed)
      elif channels.carry_data_state:
        # The prompt position a checkpoint after this step resumes from (read here,
        # saved by the trainer).
        metrics[DATA_STATE] = feed.state_before(step + 1)
      channels.rollouts.put((step, rollout, metrics), stop_event=stop)
    channels.rollouts.close()

  def infer_worker(stop: threading.Event) -> None:
    for step, rollout, metrics in _received(channels.rollouts, stop):
      actor_version = int(metrics.pop("generate_version"))
      if channels.kl_coefs is not None and actor_version not in system.kl_coefs:
        system.kl_coefs[actor_version] = channels.kl_coefs.wait(actor_version, stop)
      # The newest critic, at least as new as the actor that sampled the batch (it is
      # published first); without a critic the span carries the sampling policy's version.
      critic, version = (channels.critic.wait_for(actor_version, stop_event=stop)
                         if channels.critic is not None else (None, actor_version))
      with tracer.span("infer", batch=step, version=version, **span_args):
        exp, inf_metrics = system.infer(rollout, critic, actor_version=actor_version,
                                        critic_version=version)
      channels.experience.put((step, exp, {**metrics, **inf_metrics}), stop_event=stop)
    channels.experience.close()

  def train_worker(stop: threading.Event) -> None:
    for step, exp, metrics in _received(channels.experience, stop):
      with tracer.span("train", batch=step, version=system.version, **span_args):
        metrics.update(system.train(exp, step, observed_kl=metrics.get("kl/mean", 0.0)))
      new = None
      if channels.sync_in_step:
        with tracer.span("sync", batch=step, version=system.version, **span_args):
          new = _new_weights(system, channels)
        for name in ("actor", "critic"):
          stats = new.get(name, (None, None))[1]
          if stats is not None:
            metrics.update(stats.as_metrics(f"transfer/{name}_sync"))
      metrics.update(channels.rollouts.metrics())
      metrics.update(channels.experience.metrics())
      if DATA_STATE in metrics:
        feed.remember(step + 1, metrics.pop(DATA_STATE))
      # From generation start to the end of the update, by wall clocks (exact on one
      # machine, as good as the hosts' clock synchronisation across machines).
      metrics["time/step_s"] = time.time() - metrics.pop(GENERATE_START)
      # Record (metrics, checkpoint) before publishing: publishing fails once a shutdown
      # has begun, and a trained step must never go unrecorded.
      finish_step(system, step, metrics, on_step)
      if boundary.reached(step):
        raise StopHere()
      if new is not None:
        _publish(system, channels, new, system.version)
        continue
      with tracer.span("sync", batch=step, version=system.version, **span_args):
        _publish(system, channels, _new_weights(system, channels), system.version)

  workers = {"generate": generate_worker, "infer": infer_worker, "train": train_worker}
  for stage in channels.stages:
    group.add(stage, workers[stage])
  if "train" in channels.stages:  # the version the first batches are generated with
    _publish(system, channels, _new_weights(system, channels), system.version)
  if not channels.stages:
    return False
  group.start()
  return not group.join(timeout=timeout, should_stop=boundary.requested)
