"""The three PPO schedules over one `PPOSystem`: sequential, per_stage and pipe.

`run_serial` (modes `sequential` and `per_stage`) calls generate -> infer -> train one
after another; the two modes differ only in the layouts `build_layouts` gives the stages.

`run_pipe` runs one worker thread per stage on disjoint device subsets, linked by bounded
queues (back-pressure), with versioned weights: generation of batch k waits until the
actor has at least version k - max_staleness (0 = on-policy, which reproduces the serial
schedule). The first exception in any worker stops every worker and is re-raised here.
The workers are `pipe_loop`'s; `run_pipe` gives them this process's queues and slots.

Both record a span per stage per batch in the tracer and call `on_step(step, metrics)`
after each training update from the thread that owns the trainer state, which is where
checkpoints are written: a checkpoint holds the trainer state after update k and the
data position of batch k + 1. Rollouts in flight are not saved; on resume they are
re-generated from the restored policy (so no rollout is lost or trained on twice).

Stopping (a signal, `concurrency/interrupts.py`): after every finished step the schedule asks
its `StepBoundary` whether the job stops there (`pipe` mode's join loop also polls it, so
workers blocked in a wait leave at once). `run` then returns True; the caller writes the
checkpoint of the last finished step (`system.version - 1`), which is whole: an update
and its version are committed together (`PPOSystem.train`).

Without a critic (a critic-free advantage estimator) nothing of one is synced or
published, and no critic version or staleness is reported.

In a multi-process job `run` hands `pipe` mode to `pipe_processes`, which runs the same
`pipe_loop` workers with each stage on its own group of processes (one process, or
several whole processes running the stage SPMD) and the channels between groups carried
by `distributed.transfer`.
"""

from __future__ import annotations

import time

from pipe_rlhf_jax.concurrency.queues import BoundedQueue
from pipe_rlhf_jax.concurrency.tracing import Tracer
from pipe_rlhf_jax.concurrency.weights import VersionedWeights
from pipe_rlhf_jax.distributed.stopping import StepBoundary
from pipe_rlhf_jax.system.pipe_loop import PipeChannels, run_pipe_workers
from pipe_rlhf_jax.system.steps import DataFeed, OnStep, finish_step
from pipe_rlhf_jax.system.system import PPOSystem


class NeverStop:
  """The boundary of a library run that handles no signals: it never stops, and (in a
  multi-process job) asks nothing of the other processes."""

  stop_step = None
  signum = None

  def reached(self, step: int) -> bool:
    del step
    return False

  def requested(self) -> bool:
    return False

  def timeout_s(self) -> float:
    return 600.0


def run_serial(system: PPOSystem, feed: DataFeed, start: int, end: int, on_step: OnStep,
               tracer: Tracer, boundary: StepBoundary) -> bool:
  """sequential / per_stage: the stages one after another on shared devices.

  Returns True when the job agreed to stop after a step.
  """
  for step in range(start, end):
    t0 = time.perf_counter()
    batch = feed.next(step)
    with tracer.span("sync", batch=step, version=system.version):
      actor, actor_stats = system.actor_for_generation()
      critic, critic_stats = system.critic_for_inference()
    with tracer.span("generate", batch=step, version=system.version):
      rollout, gen_m = system.generate(actor, batch, step, system.version)
    system.trace_generation(tracer, step)
    with tracer.span("infer", batch=step, version=system.version):
      exp, inf_m = system.infer(rollout, critic, actor_version=system.version,
                                critic_version=system.version)
    with tracer.span("train", batch=step, version=system.version):
      train_m = system.train(exp, step, observed_kl=inf_m.get("kl/mean", 0.0))
    metrics = {**gen_m, **inf_m, **train_m, **actor_stats.as_metrics("transfer/actor_sync"),
               "time/step_s": time.perf_counter() - t0}
    if system.has_critic:
      metrics.update(critic_stats.as_metrics("transfer/critic_sync"))
    finish_step(system, step, metrics, on_step)
    if boundary.reached(step):
      return True
  return False


def run_pipe(system: PPOSystem, feed: DataFeed, start: int, end: int, on_step: OnStep,
             tracer: Tracer, boundary: StepBoundary, timeout: float | None = None) -> bool:
  """pipe: generate / infer / train workers running concurrently on disjoint devices,
  linked in this process by bounded queues and versioned-weights slots.

  Returns True when the run stopped on a request.
  """
  cfg = system.plan
  channels = PipeChannels(
      rollouts=BoundedQueue(cfg.queue_size, "rollouts"),
      experience=BoundedQueue(cfg.queue_size, "experience"),
      actor=VersionedWeights(),
      # No critic: nothing of one is synced or published.
      critic=VersionedWeights() if system.has_critic else None)
  return run_pipe_workers(system, feed, start, end, on_step, tracer, boundary, channels,
                          timeout=timeout)


def run(system: PPOSystem, feed: DataFeed, start: int, end: int, on_step: OnStep,
        tracer: Tracer, boundary: StepBoundary | None = None) -> bool:
  """Runs PPO steps [start, end) in `system.mode`.

  Returns True when the run stopped at a step boundary on a stop request (`boundary`;
  default: none is ever made); the last finished step is then `system.version - 1`.
  """
  from pipe_rlhf_jax import distributed
  boundary = boundary or NeverStop()
  if system.mode == "pipe" and distributed.process_count() > 1:
    from pipe_rlhf_jax.system.pipe_processes import run_pipe_across_processes
    return run_pipe_across_processes(system, feed, start, end, on_step, tracer, boundary)
  if system.mode == "pipe":
    return run_pipe(system, feed, start, end, on_step, tracer, boundary)
  return run_serial(system, feed, start, end, on_step, tracer, boundary)
