"""`pipe` mode across processes: stage groups of whole processes, links between them.

The workers are `pipe_loop`'s, as in one process (the same staleness gate, versioning,
metrics and spans); what changes is where each piece lives, and so the channels this
module gives them. Each stage lives on a group of processes (`stage_processes`): either
within one process (a process may then hold several stages, as on one machine) or
spanning several whole processes, which then hold no other stage. Each process runs only
the workers of its own stages; the processes of a multi-process stage all run its
worker, in lockstep, issuing the same programs in the same order (SPMD inside the group;
the stage's programs and `distributed.fetch` are collectives over the group's mesh
only). The first process of a group is its leader.

A channel between two stages of one process is the usual bounded queue or
versioned-weights slot; a link between groups (`_Link`, `_Weights`) goes through
`distributed.transfer` (transfer servers for the arrays, the key-value store for ids,
versions, layouts and back-pressure): the sending group gathers within itself when its
arrays span processes, its leader lays out each receiving process's block as that
process will hold it (a mirror of its sub-mesh on the leader's devices) and offers it;
each receiving process pulls its own block, checks its layout first, and assembles the
stage's global arrays from its shards:

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
from pipe_rlhf_jax.concurrency.queues import BoundedQueue
from pipe_rlhf_jax.concurrency.tracing import Tracer
from pipe_rlhf_jax.concurrency.weights import VersionedWeights
from pipe_rlhf_jax.config import STAGES
from pipe_rlhf_jax.distributed import transfer as tr
from pipe_rlhf_jax.distributed.stopping import StepBoundary
from pipe_rlhf_jax.parallel.mesh import describe
from pipe_rlhf_jax.ppo.types import Experience, Rollout
from pipe_rlhf_jax.system.pipe_loop import PipeChannels, run_pipe_workers


def stage_processes(layouts, owner: Callable[[Any], int] = tr.process_of
                    ) -> dict[str, tuple[int, ...]]:
  """Each stage's group of processes (sorted; the first is the group's leader).

  `owner(device)` is a device's process (tests simulate processes with it).

  Raises ValueError (naming plan.placement) when a stage spanning several processes
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
            f"plan.placement: in pipe mode across processes a stage spanning several "
            f"processes must have them to itself, but the {stage} stage "
            f"({describe(layouts[stage].mesh)}) spans processes {list(procs)} and "
            f"process {shared[0]} also holds the {other} stage: their threads would "
            f"issue cross-process programs in different orders and could deadlock. Cut "
            f"plan.placement at process boundaries ({jax.local_device_count()} "
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
  """A `pipe_loop.Stream` of (step, pytree, metrics) items between two stage groups.

  Args:
    name: the stream's name ("rollouts", "experience").
    kind: the pytree's class (`Rollout`, `Experience`).
    producer / consumer: the two stages' groups of processes (`stage_processes`),
      different ones (stages of one process share a `BoundedQueue`).
    layout: the consuming stage's `StageLayout` (batch-sharded arrays on arrival).
    capacity: items in flight at most.
  """

  in_process = False

  def __init__(self, name: str, kind: type, producer: tuple[int, ...],
               consumer: tuple[int, ...], layout, capacity: int):
    self.name, self.kind, self.layout = name, kind, layout
    self.me = distributed.process_index()
    if self.me in producer:
      self.sender = tr.QueueSender(name, consumer, capacity, group=producer)
    elif self.me in consumer:
      self.receiver = tr.QueueReceiver(name, producer[0], self._target)

  def _target(self, meta: dict) -> Any:
    leaves = [jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=(
        self.layout.batch_sharding(len(shape)) if shape else self.layout.replicated))
              for shape, dtype in meta["shapes"]]
    return jax.tree.unflatten(_treedef(self.kind, meta["absent"]), leaves)

  def put(self, item: tuple[int, Any, dict], timeout: float | None = None,
          stop_event: threading.Event | None = None) -> None:
    # Every process of the producing group calls this (SPMD); the sender lays out each
    # consuming process's block as the consumer's stage will hold it.
    step, tree, metrics = item
    shapes = [[list(x.shape), str(x.dtype)] for x in jax.tree.leaves(tree)]
    self.sender.put(tree, self.layout.batch_shardings(tree),
                    {"step": step, "metrics": metrics, "shapes": shapes,
                     "absent": _absent_fields(tree)}, stop=stop_event, timeout_s=timeout)

  def get(self, timeout: float | None = None,
          stop_event: threading.Event | None = None) -> tuple[int, Any, dict]:
    """The next (step, tree, metrics); `tr.StreamEnded` after the last one."""
    tree, meta = self.receiver.get(stop=stop_event, timeout_s=timeout)
    return meta["step"], tree, meta["metrics"]

  def close(self) -> None:
    self.sender.close()

  def metrics(self) -> dict[str, float]:
    return {}


class _Weights:
  """A `pipe_loop.Weights` channel from the training group to another stage group."""

  in_process = False

  def __init__(self, name: str, source: tuple[int, ...], consumer: tuple[int, ...], layout,
               abstract: Any, complete: Callable[[Any], Any]):
    self.me = distributed.process_index()
    self.name = name
    # The trainable parameters arrive; `complete` adds the consumer's frozen ones.
    self.complete = complete
    self.publisher = None
    if self.me in source:
      self.publisher = tr.WeightPublisher(name, consumer, layout.param_shardings(abstract),
                                          group=source)
    elif self.me in consumer:
      self.subscriber = tr.WeightSubscriber(name, source[0], jax.tree.map(
          lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract,
          layout.param_shardings(abstract)), group=consumer)

  def publish(self, params: Any, version: int) -> None:
    self.publisher.publish(params, version)

  def wait_for(self, min_version: int, stop_event: threading.Event | None = None,
               timeout: float | None = None) -> tuple[Any, int]:
    params, version = self.subscriber.acquire(min_version, stop=stop_event,
                                              timeout_s=timeout)
    return self.complete(params), version

  def close(self) -> None:
    """Stops serving versions (once no peer may still pull one)."""
    if self.publisher is not None:
      self.publisher.close()


class _KLCoefficients:
  """Each policy version's KL coefficient through the key-value store
  (`pipe_loop.KLCoefficients`), written once, by the training group's leader."""

  def __init__(self, endpoint, writer: int):
    self.endpoint, self.writer = endpoint, writer

  def share(self, version: int, coef: float) -> None:
    if distributed.process_index() == self.writer:
      self.endpoint.put(f"kl_coef/{version}", coef)

  def wait(self, version: int, stop: threading.Event) -> float:
    return self.endpoint.wait_get(f"kl_coef/{version}", stop=stop, timeout_s=None,
                                  poll_s=0.005)


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
  cfg = system.plan
  where = stage_processes(system.layouts)
  me = distributed.process_index()
  trainer = where["train"][0]  # the training group's leader
  endpoint = tr.Endpoint.get()
  abstract = system.abstract_params()
  # Stream names are unique per run (a job may call `run` again): their keys and ids
  # never meet a previous run's.
  run = f"{start}-{end}"

  def stream(name: str, kind: type, producer: str, consumer: str):
    if where[producer] == where[consumer]:  # one process holding both stages
      return BoundedQueue(cfg.queue_size, f"{name}@{run}")
    return _Link(f"{name}@{run}", kind, where[producer], where[consumer],
                 system.layouts[consumer], cfg.queue_size)

  def weights(name: str, consumer: str):
    if where["train"] == where[consumer]:
      return VersionedWeights()
    return _Weights(f"{name}@{run}", where["train"], where[consumer],
                    system.layouts[consumer], abstract[name],
                    complete=lambda params: system.with_frozen(name, params))

  channels = PipeChannels(
      rollouts=stream("rollouts", Rollout, "generate", "infer"),
      experience=stream("experience", Experience, "infer", "train"),
      actor=weights("actor", "generate"),
      # Without a critic (critic-free estimators) there is nothing to publish.
      critic=weights("critic", "infer") if system.has_critic else None,
      stages=tuple(s for s in STAGES if me in where[s]),
      sync_in_step=False, span_args={"process": f"p{me}"}, carry_data_state=True,
      kl_coefs=_KLCoefficients(endpoint, trainer))
  stopped = run_pipe_workers(system, feed, start, end, on_step, tracer, boundary, channels)
  # A peer may still pull the last items from this process's server.
  distributed.barrier(f"pipe_run_{run}_done", timeout_s=boundary.timeout_s())
  gather_trace(tracer, endpoint, trainer, run, timeout_s=boundary.timeout_s())
  for link in channels.weights().values():
    if not link.in_process:
      link.close()
  return stopped
