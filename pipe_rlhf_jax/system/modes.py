"""The three PPO schedules over one `PPOSystem`: sequential, per_stage and pipe.

`run_serial` (modes `sequential` and `per_stage`) calls generate -> infer -> train one
after another; the two modes differ only in the layouts `build_layouts` gives the stages.

`run_pipe` runs one worker thread per stage on disjoint device subsets, linked by bounded
queues (back-pressure), with versioned weights: generation of batch k waits until the
actor has at least version k - max_staleness (0 = on-policy, which reproduces the serial
schedule). The first exception in any worker stops every worker and is re-raised here.

Both record a span per stage per batch in the tracer and call `on_step(step, metrics)`
after each training update from the thread that owns the trainer state, which is where
checkpoints are written: a checkpoint holds the trainer state after update k and the
data position of batch k + 1. Rollouts in flight are not saved; on resume they are
re-generated from the restored policy (so no rollout is lost or trained on twice).

Without a critic (a critic-free advantage estimator) nothing of one is synced or
published, and no critic version or staleness is reported.

In a multi-process job `run` hands `pipe` mode to `pipe_processes`, which runs the same
workers with each stage on its own group of processes (one process, or several whole
processes running the stage SPMD) and the links between groups carried by
`distributed.transfer`.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from pipe_rlhf_jax.runtime.queues import BoundedQueue
from pipe_rlhf_jax.runtime.tracing import Tracer
from pipe_rlhf_jax.runtime.weights import StalenessGate, VersionedWeights
from pipe_rlhf_jax.runtime.workers import WorkerGroup
from pipe_rlhf_jax.system.system import PPOSystem, np_batch

OnStep = Callable[[int, dict], None]


class DataFeed:
  """Prompt batches by step index, remembering the source's state before each one.

  The prompt source is any iterator of batches (the protocol, `system.api.PromptSource`):
  `next()` gives {"prompt_tokens": int32 [batch, prompt_len] left-padded, "prompt_mask":
  bool [batch, prompt_len], "index": int [batch] (global sample ids, which key the
  sampling randomness)}; `get_state()` / `set_state()` are optional and make a run
  resumable. The checkpoint of step k stores the state before batch k + 1 even when the
  generator has already read further ahead.
  """

  def __init__(self, source):
    self.source = source
    self._resumable = hasattr(source, "get_state")
    self._states: dict[int, dict | None] = {}
    self._lock = threading.Lock()

  def _state(self) -> dict | None:
    return self.source.get_state() if self._resumable else None

  def next(self, step: int) -> dict:
    with self._lock:
      self._states[step] = self._state()
      try:
        return np_batch(next(self.source))
      except StopIteration:
        raise RuntimeError(f"The prompt source ran out before PPO step {step}; give an "
                           "endless (or long enough) source.") from None

  def remember(self, step: int, state: dict | None) -> None:
    """Records the source's state before batch `step` as read elsewhere (pipe mode
    across processes: the generating process reads the prompts, the trainer's process
    checkpoints)."""
    with self._lock:
      self._states[step] = state

  def state_before(self, step: int) -> dict | None:
    with self._lock:
      for old in [k for k in self._states if k < step - 8]:
        del self._states[old]
      return self._states.get(step, self._state())


class BadStepGuard:
  """Stops the run after `limit` consecutive PPO steps with a skipped update."""

  def __init__(self, limit: int):
    self.limit = limit
    self.streak = 0
    self.total = 0

  def check(self, step: int, metrics: dict) -> None:
    bad = metrics.get("bad_updates", 0.0) > 0
    self.total += int(bad)
    self.streak = self.streak + 1 if bad else 0
    metrics["bad_steps_total"] = float(self.total)
    if self.streak >= self.limit:
      raise FloatingPointError(
          f"PPO step {step}: {self.streak} consecutive steps had non-finite losses or "
          f"gradients (updates skipped); stopping. Lower ppo.actor_lr / ppo.critic_lr, or "
          f"raise ppo.max_bad_steps to tolerate more.")


def _finish_step(system: PPOSystem, step: int, metrics: dict, guard: BadStepGuard,
                 on_step: OnStep) -> None:
  """After update `step`: staleness of the batch it trained on, the next version's KL
  coefficient, the bad-step guard, then the caller's hook (metrics, checkpoint)."""
  # How many updates the trainer was ahead of the policy / critic that made the batch.
  metrics["staleness/actor"] = float(system.version - metrics["version/actor"])
  if system.has_critic:
    metrics["staleness/critic"] = float(system.version - metrics["version/critic"])
  system.advance(metrics.get("kl/mean", 0.0))
  guard.check(step, metrics)
  on_step(step, metrics)


def run_serial(system: PPOSystem, feed: DataFeed, start: int, end: int, on_step: OnStep,
               tracer: Tracer) -> None:
  """sequential / per_stage: the stages one after another on shared devices."""
  guard = BadStepGuard(system.ppo.max_bad_steps)
  for step in range(start, end):
    t0 = time.perf_counter()
    batch = feed.next(step)
    with tracer.span("sync", batch=step, version=system.version):
      actor, actor_stats = system.actor_for_generation()
      critic, critic_stats = system.critic_for_inference()
    with tracer.span("generate", batch=step, version=system.version):
      rollout, gen_m = system.generate(actor, batch, step, system.version)
    with tracer.span("infer", batch=step, version=system.version):
      exp, inf_m = system.infer(rollout, critic, actor_version=system.version,
                                critic_version=system.version)
    with tracer.span("train", batch=step, version=system.version):
      train_m = system.train(exp, step)
    metrics = {**gen_m, **inf_m, **train_m, **actor_stats.as_metrics("transfer/actor_sync"),
               "time/step_s": time.perf_counter() - t0}
    if system.has_critic:
      metrics.update(critic_stats.as_metrics("transfer/critic_sync"))
    _finish_step(system, step, metrics, guard, on_step)


def run_pipe(system: PPOSystem, feed: DataFeed, start: int, end: int, on_step: OnStep,
             tracer: Tracer, on_interrupt: Callable | None = None,
             timeout: float | None = None) -> None:
  """pipe: generate / infer / train workers running concurrently on disjoint devices."""
  cfg = system.runtime
  guard = BadStepGuard(system.ppo.max_bad_steps)
  actor, actor_stats = system.actor_for_generation()
  critic, _ = system.critic_for_inference()
  actor_store = VersionedWeights(actor, version=system.version)
  # No critic: a store that always holds None at the actor's versions is never needed.
  critic_store = (VersionedWeights(critic, version=system.version) if system.has_critic
                  else None)
  gate = StalenessGate(actor_store, cfg.max_staleness)
  rollouts = BoundedQueue(cfg.queue_size, "rollouts")
  experience = BoundedQueue(cfg.queue_size, "experience")
  # A worker is only stopped between items, and an item can be a first call that is
  # still compiling: the bound is generous, but it is a bound (shutdown never hangs).
  group = WorkerGroup(on_interrupt=on_interrupt, shutdown_timeout=cfg.shutdown_timeout_s)
  for obj in (rollouts, experience, actor_store, critic_store):
    if obj is not None:
      group.register_queue(obj)
  step_start: dict[int, float] = {}

  def generate_worker(stop: threading.Event) -> None:
    for step in range(start, end):
      batch = feed.next(step)
      waited = time.perf_counter()
      params, version = gate.acquire(step, stop_event=stop)
      step_start[step] = time.perf_counter()
      with tracer.span("generate", batch=step, version=version):
        rollout, metrics = system.generate(params, batch, step, version)
      metrics["generate_version"] = version
      metrics["time/weights_wait_s"] = step_start[step] - waited
      rollouts.put((step, rollout, metrics), stop_event=stop)
    rollouts.close()

  def infer_worker(stop: threading.Event) -> None:
    for step, rollout, metrics in rollouts:
      actor_version = metrics.pop("generate_version")
      # The span carries the critic's version, or without a critic the sampling policy's.
      critic, version = (critic_store.latest() if critic_store is not None
                         else (None, actor_version))
      with tracer.span("infer", batch=step, version=version):
        exp, inf_metrics = system.infer(rollout, critic, actor_version=actor_version,
                                        critic_version=version)
      experience.put((step, exp, {**metrics, **inf_metrics}), stop_event=stop)
    experience.close()

  def train_worker(stop: threading.Event) -> None:
    for step, exp, metrics in experience:
      with tracer.span("train", batch=step, version=system.version):
        metrics.update(system.train(exp, step))
      with tracer.span("sync", batch=step, version=system.version + 1):
        critic, critic_stats = system.critic_for_inference()
        actor, actor_stats = system.actor_for_generation()
      metrics.update(actor_stats.as_metrics("transfer/actor_sync"))
      if critic_store is not None:
        metrics.update(critic_stats.as_metrics("transfer/critic_sync"))
      metrics.update(rollouts.metrics())
      metrics.update(experience.metrics())
      metrics["time/step_s"] = time.perf_counter() - step_start.get(step, time.perf_counter())
      # Record (metrics, checkpoint) before publishing: publishing fails once a shutdown
      # has begun, and a trained step must never go unrecorded.
      _finish_step(system, step, metrics, guard, on_step)
      # The critic first: an on-policy generator released by the actor's version must
      # find the matching critic when its batch reaches inference.
      if critic_store is not None:
        critic_store.publish(critic, system.version)
      actor_store.publish(actor, system.version)

  group.add("generate", generate_worker)
  group.add("infer", infer_worker)
  group.add("train", train_worker)
  group.start()
  group.join(timeout=timeout)


def run(system: PPOSystem, feed: DataFeed, start: int, end: int, on_step: OnStep,
        tracer: Tracer, on_interrupt: Callable | None = None) -> None:
  """Runs PPO steps [start, end) in `system.mode`."""
  from pipe_rlhf_jax import distributed
  if system.mode == "pipe" and distributed.process_count() > 1:
    from pipe_rlhf_jax.system.pipe_processes import run_pipe_across_processes
    run_pipe_across_processes(system, feed, start, end, on_step, tracer,
                              on_interrupt=on_interrupt)
  elif system.mode == "pipe":
    run_pipe(system, feed, start, end, on_step, tracer, on_interrupt=on_interrupt)
  else:
    try:
      run_serial(system, feed, start, end, on_step, tracer)
    except KeyboardInterrupt:
      if on_interrupt is not None:
        on_interrupt()
      raise
