"""A discrete-event simulation of PPO steps under a plan, from per-stage seconds.

It mirrors `system/modes.py`:
  serial (`sequential`, `per_stage`): per step sync -> generate -> infer -> train.
  pipe: three workers on their own devices. Generation of batch k waits until the actor
    has version >= k - max_staleness (the staleness gate), then puts its rollout into a
    bounded queue (blocking while `queue_size` rollouts wait: back-pressure); inference
    takes rollouts in order and puts experience into the second bounded queue; training
    takes experience, updates (version k + 1 once done) and syncs weights (a span
    "sync" on the trainer), then publishes the version.
On shared hardware (`shared_host`: virtual devices on one host's cores) the tasks running
at one moment share the host: a task alone uses a fraction `demand` of the host (its
devices' share of the host's throughput, 1 when they can use all of it); when the running
tasks' demands sum to D > 1, each progresses at 1/D of its solo speed (processor sharing),
so concurrency adds no compute beyond the host's. Otherwise each worker runs at
full speed on its own devices. `exclusive` stages (on hardware whose multi-device
programs run one at a time: `Hardware.serial_multi_device`) never progress together: the
one that started first runs, the others wait inside their spans (as a stage call waits
for its program in the system), first come first served.

Outputs steady-state seconds per step (mean step period after a warm-up), per-stage busy
fractions, mean staleness, and one span per stage per batch in a `concurrency.tracing.Tracer`,
so `tracer.gantt(path)` draws the predicted run like the system draws a measured one.
"""

from __future__ import annotations

import dataclasses

from pipe_rlhf_jax.concurrency.tracing import Tracer

_EPS = 1e-12
TASKS = ("generate", "infer", "train", "sync")  # what a worker runs, in this order


@dataclasses.dataclass(frozen=True)
class SimResult:
  """Steady seconds per step, busy fraction per stage, mean staleness, the spans."""

  step_time: float
  busy: dict
  staleness: float
  tracer: Tracer
  finish_times: tuple[float, ...]


class _Task:
  def __init__(self, worker: str, stage: str, batch: int, version: int, work: float):
    self.worker, self.stage, self.batch, self.version = worker, stage, batch, version
    self.remaining = float(work)
    self.start = None


def _steady(finish: list[float], warmup: int) -> float:
  n = len(finish)
  warmup = min(warmup, n - 2) if n > 2 else 0
  if n < 2:
    return finish[0] if finish else 0.0
  return (finish[-1] - finish[warmup]) / (n - 1 - warmup)


def simulate(times: dict[str, float], sync: float, mode: str, *, max_staleness: int = 0,
             queue_size: int = 2, shared_host: bool = False,
             demands: dict[str, float] | None = None, exclusive=frozenset(),
             steps: int = 24, warmup: int | None = None) -> SimResult:
  """Simulates `steps` PPO steps.

  Args:
    times: solo seconds of "generate", "infer", "train" per batch.
    sync: seconds of the weight sync after each update.
    mode: "sequential", "per_stage" or "pipe".
    max_staleness / queue_size: the pipe schedule's bounds.
    shared_host: concurrent tasks share one host's throughput.
    demands: with shared_host, the fraction of the host each stage ("generate", "infer",
      "train", "sync") uses alone (default 1).
    exclusive: stages that cannot run at the same time as one another.
    steps: PPO steps simulated; the steady period is measured after `warmup` of them
      (default steps // 3).
  """
  warmup = steps // 3 if warmup is None else warmup
  tracer = Tracer(origin=0.0)
  if mode != "pipe":
    now, finish = 0.0, []
    for k in range(steps):
      for stage, work in (("sync", sync), ("generate", times["generate"]),
                          ("infer", times["infer"]), ("train", times["train"])):
        tracer.add(stage, now, now + work, batch=k, version=k, thread=stage)
        now += work
      finish.append(now)
    total = now
    busy = {s: (steps * (times[s] if s != "sync" else sync)) / total if total else 0.0
            for s in TASKS}
    return SimResult(_steady(finish, warmup), busy, 0.0, tracer, tuple(finish))
  demands = {s: 1.0 for s in TASKS} | dict(demands or {})
  return _simulate_pipe(times, sync, max_staleness, queue_size, shared_host, demands,
                        frozenset(exclusive), steps, warmup, tracer)


def _simulate_pipe(times, sync, staleness, queue_size, shared_host, demands, exclusive,
                   steps, warmup, tracer):
  now = 0.0
  version = 0  # published actor version
  rollouts: list = []  # (batch, version) waiting for inference
  experience: list = []  # (batch, version) waiting for training
  held = {"generate": None, "infer": None}  # finished item blocked on a full queue
  running: dict[str, _Task] = {}
  next_gen = 0
  train_batch = None
  finish: list[float] = []
  staleness_of: dict[int, int] = {}
  busy_time = {s: 0.0 for s in TASKS}

  def start(worker, stage, batch, ver, work):
    task = _Task(worker, stage, batch, ver, work)
    task.start = now
    running[worker] = task

  while len(finish) < steps:
    # Hand over blocked items when their queue has room (back-pressure released).
    progressed = True
    while progressed:
      progressed = False
      if held["generate"] is not None and len(rollouts) < queue_size:
        rollouts.append(held["generate"])
        held["generate"] = None
        progressed = True
      if held["infer"] is not None and len(experience) < queue_size:
        experience.append(held["infer"])
        held["infer"] = None
        progressed = True
      # Generation keeps going past the last measured step (as in a longer run), so the
      # last steps do not run with less contention than the steady state.
      if ("generate" not in running and held["generate"] is None
          and version >= next_gen - staleness):
        staleness_of[next_gen] = next_gen - version
        start("generate", "generate", next_gen, version, times["generate"])
        next_gen += 1
        progressed = True
      if "infer" not in running and held["infer"] is None and rollouts:
        batch, ver = rollouts.pop(0)
        start("infer", "infer", batch, ver, times["infer"])
        progressed = True
      if "train" not in running and experience:
        batch, ver = experience.pop(0)
        train_batch = batch
        start("train", "train", batch, version, times["train"])
        progressed = True
    if not running:
      raise RuntimeError("simulator deadlock: no task can run (a bug in the plan's "
                         "bounds or in the simulator).")
    # Of the exclusive tasks, only the earliest started progresses; the rest wait.
    queued = sorted((w for w, task in running.items() if task.stage in exclusive),
                    key=lambda w: (running[w].start, TASKS.index(running[w].stage)))
    active = [w for w in running if w not in queued[1:]]
    # Processor sharing on a shared host: demands summing to D > 1 each go at 1/D.
    load = sum(demands[running[w].stage] for w in active)
    rate = 1.0 / max(1.0, load) if shared_host else 1.0
    worker = min(active, key=lambda w: running[w].remaining)
    dt = running[worker].remaining / rate
    now += dt
    for w, task in running.items():
      if w in active:
        task.remaining -= dt * rate
      busy_time[task.stage] += dt
    done = [w for w, task in running.items() if task.remaining <= _EPS * max(1.0, now)]
    for w in done:
      task = running.pop(w)
      tracer.add(task.stage, task.start, now, batch=task.batch, version=task.version,
                 thread=task.worker)
      if task.stage == "generate":
        held["generate"] = (task.batch, task.version)
      elif task.stage == "infer":
        held["infer"] = (task.batch, task.version)
      elif task.stage == "train":
        if sync > 0:
          start("train", "sync", train_batch, version + 1, sync)
        else:
          version += 1
          finish.append(now)
      else:  # sync done: the new version is published
        version += 1
        finish.append(now)
  total = now
  busy = {s: v / total for s, v in busy_time.items()}
  tail = [staleness_of[k] for k in range(min(warmup, steps - 1), steps)]
  return SimResult(_steady(finish, warmup), busy, sum(tail) / len(tail), tracer,
                   tuple(finish))
