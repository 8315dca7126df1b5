"""`pipe` mode across processes: stage groups of whole processes, links between them.

The schedule is `modes.run_pipe`'s (the same workers, staleness gate, versioning and
metrics); what changes is where each piece lives. Each stage lives on a group of
processes (`stage_processes`): either within one process (a process may then hold
several stages, as on one machine) or spanning several whole processes, which then hold
no other stage. Each process runs only the workers of its own stages; the processes of
a multi-process stage all run its worker, in lockstep, issuing the same programs in the
same order (SPMD inside the group; the stage's programs and `distributed.fetch` are
collectives over the group's mesh only). The first process of a group is its leader.

A link between two stages of one process is the usual bounded queue or versioned-weights
slot; a link between groups goes through `distributed.transfer` (transfer servers for the
arrays, the key-value store for ids, versions, layouts and back-pressure): the sending
group gathers within itself when its arrays span processes, its leader lays out each
receiving process's block as that process will hold it (a mirror of its sub-mesh on the
leader's devices) and offers it; each receiving process pulls its own block, checks its
layout first, and assembles the stage's global arrays from its shards:

  generate --rollouts--> infer --experience--> train
  train --actor vK--> generate        train --critic vK--> infer

Every process of a consuming group receives the same weights version for a step (its
leader asks; the grant names the version for all). The KL coefficient of each policy
version is fixed by the trainer; an inference stage in another process reads it from the
key-value store. `on_step` runs in the training stage's processes only (in every one of
a multi-process training group, in lockstep), and so do metrics and the trainer state;
the trace is gathered into the training group's leader; the run ends with a barrier so
that no process leaves while a peer may still pull from its server.

Limits (errors say so): a stage spanning several processes must have them to itself
(two stages' threads in one process issuing cross-process programs in different orders
could deadlock), each of its processes' devices must be a rectangular block of its mesh,
and a sending process needs at least as many devices as a receiving process holds of the
receiving stage's mesh.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

import jax

from pipe_rlhf_jax import distributed
from pipe_rlhf_jax.distributed import transfer as tr
from pipe_rlhf_jax.distributed.stopping import StepBoundary
from pipe_rlhf_jax.parallel.mesh import describe
from pipe_rlhf_jax.ppo.types import Experience, Rollout
from pipe_rlhf_jax.runtime.queues import BoundedQueue
from pipe_rlhf_jax.runtime.tracing import Tracer
from pipe_rlhf_jax.runtime.weights import VersionedWeights, required_version
from pipe_rlhf_jax.runtime.workers import WorkerGroup
from pipe_rlhf_jax.system.settings import STAGES
from pipe_rlhf_jax.system.steps import StopHere, finish_step

# Key of the prompt source's state in the metrics that travel with a batch.
DATA_STATE = "_data_state"


def stage_processes(layouts, owner: Callable[[Any], int] = tr.process_of
                    ) -> dict[str, tuple[int, ...]]:
  """Each stage's group of processes (sorted; the first is the group's leader).

  `owner(device)` is a device's process (tests simulate processes with it).

  Raises ValueError (naming runtime.placement) when a stage spanning several processes
  shares one of them with another stage, or when a process's devices are not a
  rectangular block of a stage's mesh (it could not receive its block of an array).
  """
  out = {s: tuple(sorted({owner(d) for d in layouts[s].mesh.devices.flat}))
         for s in STAGES}
  for stage, procs in out.items():
    if len(procs) == 1:
      continue
    for other in STAGES:
      shared = sorted(set(procs) & set(out[other])) if other != stage else []
      if shared:
        raise ValueError(
            f"runtime.placement: in pipe mode across processes a stage spanning several "
            f"processes must have them to itself, but the {stage} stage "
            f"({describe(layouts[stage].mesh)}) spans processes {list(procs)} and "
            f"process {shared[0]} also holds the {other} stage: their threads would "
            f"issue cross-process programs in different orders and could deadlock. Cut "
            f"runtime.placement at process boundaries ({jax.local_device_count()} "
            f"devices per process here) so that the {stage} stage's processes hold no "
            f"other stage, or fit the {stage} stage within one process.")
    for p in procs:
      tr.process_submesh(layouts[stage].mesh, p, owner)
  return out


def _absent_fields(tree: Any, prefix: str = "") -> list[str]:
  """Dotted names of the fields of a Rollout / Experience that are None (e.g. the values
  of a critic-free run): the receiver rebuilds the same pytree structure from them."""
  out = []
  for f in dataclasses.fields(tree):
    value = getattr(tree, f.name)
    if value is None:
      out.append(prefix + f.name)
    elif dataclasses.is_dataclass(value):
      out.extend(_absent_fields(value, f"{prefix}{f.name}."))
  return out


def _treedef(kind: type, absent: list[str]):
  """The pytree structure of a `kind` (Rollout / Experience) with `absent` fields None."""
  def build(cls, prefix):
    values = []
    for f in dataclasses.fields(cls):
      name = prefix + f.name
      if name in absent:
        values.append(None)
      elif cls is Experience and f.name == "rollout":
        values.append(build(Rollout, name + "."))
      else:
        values.append(0)
    return cls(*values)
  return jax.tree.structure(build(kind, ""))


class _Link:
  """A stage-to-stage queue of (step, pytree, metrics): local, or between two groups.

  Args:
    name: the stream's name ("rollouts", "experience").
    kind: the pytree's class (`Rollout`, `Experience`).
    producer / consumer: the two stages' groups of processes (`stage_processes`).
    layout: the consuming stage's `StageLayout` (batch-sharded arrays on arrival).
    capacity: items in flight at most.
  """

  def __init__(self, name: str, kind: type, producer: tuple[int, ...],
               consumer: tuple[int, ...], layout, capacity: int):
    self.name, self.kind, self.layout = name, kind, layout
    self.me = distributed.process_index()
    # Equal groups are one process holding both stages (a multi-process stage's
    # processes hold no other stage).
    self.local = producer == consumer
    if self.local:
      self.queue = BoundedQueue(capacity, name)
    elif self.me in producer:
      self.sender = tr.QueueSender(name, consumer, capacity, group=producer)
    elif self.me in consumer:
      self.receiver = tr.QueueReceiver(name, producer[0], self._target)

  def _target(self, meta: dict) -> Any:
    leaves = [jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=(
        self.layout.batch_sharding(len(shape)) if shape else self.layout.replicated))
              for shape, dtype in meta["shapes"]]
    return jax.tree.unflatten(_treedef(self.kind, meta["absent"]), leaves)

  def put(self, step: int, tree: Any, metrics: dict, stop: threading.Event) -> None:
    if self.local:
      self.queue.put((step, tree, metrics), stop_event=stop)
      return
    # Every process of the producing group calls this (SPMD); the sender lays out each
    # consuming process's block as the consumer's stage will hold it.
    shapes = [[list(x.shape), str(x.dtype)] for x in jax.tree.leaves(tree)]
    self.sender.put(tree, self.layout.batch_shardings(tree),
                    {"step": step, "metrics": metrics, "shapes": shapes,
                     "absent": _absent_fields(tree)}, stop=stop)

  def close(self) -> None:
    if self.local:
      self.queue.close()
    else:
      self.sender.close()

  def items(self, stop: threading.Event):
    """(step, tree, metrics) in order until the producer closes the link."""
    if self.local:
      yield from self.queue
      return
    while True:
      try:
        tree, meta = self.receiver.get(stop=stop)
      except tr.StreamEnded:
        return
      yield meta["step"], tree, meta["metrics"]

  def metrics(self) -> dict[str, float]:
    return self.queue.metrics() if self.local else {}


class _Weights:
  """A versioned-weights link from the trainer to a stage: local or between groups."""

  def __init__(self, name: str, source: tuple[int, ...], consumer: tuple[int, ...], layout,
               abstract: Any):
    self.me = distributed.process_index()
    self.local = source == consumer
    self.name = name
    if self.local:
      self.store = VersionedWeights()
    elif self.me in source:
      self.publisher = tr.WeightPublisher(name, consumer, layout.param_shardings(abstract),
                                          group=source)
    elif self.me in consumer:
      self.subscriber = tr.WeightSubscriber(name, source[0], jax.tree.map(
          lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract,
          layout.param_shardings(abstract)), group=consumer)

  def publish(self, params: Any, version: int) -> None:
    (self.store if self.local else self.publisher).publish(params, version)

  def acquire(self, min_version: int, stop: threading.Event) -> tuple[Any, int]:
    if self.local:
      return self.store.wait_for(min_version, stop_event=stop)
    return self.subscriber.acquire(min_version, stop=stop)


def gather_trace(tracer: Tracer, endpoint, into: int, run: str,
                 timeout_s: float = 600.0) -> None:
  """Copies every process's spans into the tracer of process `into` (which writes the
  trace), on its time axis: spans travel as wall-clock times, so processes on different
  hosts line up as well as their clocks do. Each span keeps its `process` annotation (a
  stage spanning processes has one span per process and batch)."""
  me = distributed.process_index()
  wall_at_origin = time.time() - tracer.now()
  if me != into:
    endpoint.put(f"trace/{run}/{me}", [
        [s.stage, wall_at_origin + s.start, wall_at_origin + s.end, s.batch, s.version,
         s.thread, s.args] for s in tracer.spans()])
  distributed.barrier(f"pipe_trace_{run}", timeout_s=timeout_s)
  if me == into:
    for p in range(distributed.process_count()):
      if p == into:
        continue
      for stage, begin, finish, batch, version, thread, args in endpoint.try_get(
          f"trace/{run}/{p}") or []:
        tracer.add(stage, begin - wall_at_origin, finish - wall_at_origin, batch=batch,
                   version=version, thread=thread, **args)


def run_pipe_across_processes(system, feed, start: int, end: int,
                              on_step: Callable[[int, dict], None], tracer: Tracer,
                              boundary: StepBoundary) -> bool:
  """PPO steps [start, end) in pipe mode, this process running its own stages' workers.

  `boundary` must have the training group as its voters (`stage_processes(...)["train"]`):
  they agree on the step to stop at and publish it; every other process's join loop
  reads it and stops its workers. Returns True when the job stopped on a request.
  """
  cfg = system.runtime
  where = stage_processes(system.layouts)
  me = distributed.process_index()
  mine = [s for s in STAGES if me in where[s]]
  trainer = where["train"][0]  # the training group's leader
  endpoint = tr.Endpoint.get()
  abstract = system.abstract_params()
  # Stream names are unique per run (a job may call `run` again): their keys and ids
  # never meet a previous run's.
  run = f"{start}-{end}"
  rollouts = _Link(f"rollouts@{run}", Rollout, where["generate"], where["infer"],
                   system.layouts["infer"], cfg.queue_size)
  experience = _Link(f"experience@{run}", Experience, where["infer"], where["train"],
                     system.layouts["train"], cfg.queue_size)
  actor_link = _Weights(f"actor@{run}", where["train"], where["generate"],
                        system.layouts["generate"], abstract["actor"])
  # Without a critic (critic-free estimators) there is nothing to publish.
  critic_link = (_Weights(f"critic@{run}", where["train"], where["infer"],
                          system.layouts["infer"], abstract["critic"])
                 if system.has_critic else None)
  who = f"p{me}"

  def publish(version: int) -> None:
    # The critic first (see modes.run_pipe); the KL coefficient of `version` before both,
    # for an inference stage in another process (written once, by the training leader).
    if me == trainer:
      endpoint.put(f"kl_coef/{version}", system.kl_coefs[version])
    if critic_link is not None:
      critic_link.publish(system.critic_for_inference()[0] if critic_link.local
                          else system.state.critic, version)
    actor_link.publish(system.actor_for_generation()[0] if actor_link.local
                       else system.state.actor, version)

  def generate_worker(stop: threading.Event) -> None:
    for step in range(start, end):
      batch = feed.next(step)
      waited = time.perf_counter()
      params, version = actor_link.acquire(required_version(step, cfg.max_staleness), stop)
      began = time.perf_counter()
      with tracer.span("generate", batch=step, version=version, process=who):
        rollout, metrics = system.generate(params, batch, step, version)
      metrics["generate_version"] = version
      metrics["time/weights_wait_s"] = began - waited
      # Wall clock: the batch's step time is taken in the trainer's process.
      metrics["time/generate_start"] = time.time()
      # The prompt position a checkpoint after this step resumes from (read here, saved
      # by the trainer's process).
      metrics[DATA_STATE] = feed.state_before(step + 1)
      rollouts.put(step, rollout, metrics, stop)
    rollouts.close()

  def infer_worker(stop: threading.Event) -> None:
    for step, rollout, metrics in rollouts.items(stop):
      actor_version = int(metrics.pop("generate_version"))
      if actor_version not in system.kl_coefs:
        system.kl_coefs[actor_version] = endpoint.wait_get(
            f"kl_coef/{actor_version}", stop=stop, timeout_s=None, poll_s=0.005)
      # The newest critic, at least as new as the actor that sampled the batch (without
      # a critic the span carries the sampling policy's version).
      critic, version = (critic_link.acquire(actor_version, stop)
                         if critic_link is not None else (None, actor_version))
      with tracer.span("infer", batch=step, version=version, process=who):
        exp, inf_metrics = system.infer(rollout, critic, actor_version=actor_version,
                                        critic_version=version)
      experience.put(step, exp, {**metrics, **inf_metrics}, stop)
    experience.close()

  def train_worker(stop: threading.Event) -> None:
    for step, exp, metrics in experience.items(stop):
      with tracer.span("train", batch=step, version=system.version, process=who):
        metrics.update(system.train(exp, step, observed_kl=metrics.get("kl/mean", 0.0)))
      metrics.update(rollouts.metrics())
      metrics.update(experience.metrics())
      began = metrics.pop("time/generate_start")
      feed.remember(step + 1, metrics.pop(DATA_STATE))
      # From generation start to the end of the update, by wall clocks (exact on one
      # machine, as good as the hosts' clock synchronisation across machines).
      metrics["time/step_s"] = time.time() - began
      finish_step(system, step, metrics, on_step)
      if boundary.reached(step):
        raise StopHere()
      with tracer.span("sync", batch=step, version=system.version, process=who):
        publish(system.version)

  group = WorkerGroup(shutdown_timeout=cfg.shutdown_timeout_s)
  for link in (rollouts, experience):
    if link.local:
      group.register_queue(link.queue)
  for weights in (actor_link, critic_link):
    if weights is not None and weights.local:
      group.register_queue(weights.store)
  if me in where["train"]:
    publish(system.version)
  workers = {"generate": generate_worker, "infer": infer_worker, "train": train_worker}
  for stage in mine:
    group.add(stage, workers[stage])
  stopped = False
  if mine:
    group.start()
    stopped = not group.join(should_stop=boundary.requested)
  # A peer may still pull the last items from this process's server.
  distributed.barrier(f"pipe_run_{run}_done", timeout_s=boundary.timeout_s())
  gather_trace(tracer, endpoint, trainer, run, timeout_s=boundary.timeout_s())
  for weights in (actor_link, critic_link):
    if weights is not None and not weights.local and me in where["train"]:
      weights.publisher.close()
  return stopped
