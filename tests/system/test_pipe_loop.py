"""`pipe_loop`: the one set of pipe-mode workers over in-process and cross-process channels.

A stand-in system (no models, no devices) makes each property of the channels visible:
where the weights sync runs against the step's record, what a publish is handed, which
annotations the spans carry, and that a stopped stage never closes a cross-process
stream (its consumer would take that for the end of the run).
"""

import types

import numpy as np
import pytest

from pipe_rlhf_jax.concurrency.queues import BoundedQueue
from pipe_rlhf_jax.concurrency.tracing import Tracer
from pipe_rlhf_jax.concurrency.weights import VersionedWeights
from pipe_rlhf_jax.parallel.reshard import TransferStats
from pipe_rlhf_jax.system.modes import NeverStop
from pipe_rlhf_jax.system.pipe_loop import PipeChannels, run_pipe_workers
from pipe_rlhf_jax.system.steps import BadStepGuard, DataFeed

STEPS = 4


class FakeSystem:
  """The parts of `PPOSystem` the workers use; weights are names ("A2": actor v2)."""

  def __init__(self, max_staleness=1, fail_generate_at=None):
    self.plan = types.SimpleNamespace(max_staleness=max_staleness, queue_size=2,
                                         partial_rollouts=False,
                                         shutdown_timeout_s=30.0)
    self.has_critic = True
    self.version = 0
    self.kl_coefs = {0: 0.1}
    self.guard = BadStepGuard(3)
    self.state = types.SimpleNamespace(actor="A0", critic="C0")
    self.fail_generate_at = fail_generate_at
    self.generated_with = []

  def actor_for_generation(self):
    return "resharded " + self.state.actor, TransferStats(bytes=8, seconds=1.0)

  def critic_for_inference(self):
    return "resharded " + self.state.critic, TransferStats(bytes=4, seconds=1.0)

  def generate(self, params, batch, step, version):
    if step == self.fail_generate_at:
      raise RuntimeError(f"generation failed at step {step}")
    self.generated_with.append((step, params, version))
    return {"prompts": batch["index"]}, {"gen": 1.0}

  def trace_generation(self, tracer, step):
    del tracer, step  # names, not an engine: no slots to draw

  def infer(self, rollout, critic, *, actor_version, critic_version):
    return {"rollout": rollout, "critic": critic}, {
        "version/actor": float(actor_version), "version/critic": float(critic_version),
        "kl/mean": 0.0, "kl_coef": self.kl_coefs[actor_version]}

  def train(self, exp, step, *, observed_kl):
    del exp, observed_kl
    self.kl_coefs[self.version + 1] = self.kl_coefs[self.version]
    self.version += 1
    self.state = types.SimpleNamespace(actor=f"A{self.version}", critic=f"C{self.version}")
    return {"loss": float(step)}


class RemoteStream:
  """A stand-in for a cross-process link: a queue that a stop does not abort."""

  in_process = False

  def __init__(self, name):
    self.queue = BoundedQueue(2, name)
    self.closes = 0

  def put(self, item, timeout=None, stop_event=None):
    self.queue.put(item, timeout=timeout, stop_event=stop_event)

  def get(self, timeout=None, stop_event=None):
    return self.queue.get(timeout=timeout, stop_event=stop_event)

  def close(self):
    self.closes += 1
    self.queue.close()

  def metrics(self):
    return {}


class RemoteWeights:
  """A stand-in for a cross-process weights link, remembering what it was handed."""

  in_process = False

  def __init__(self):
    self.store = VersionedWeights()
    self.published = []

  def publish(self, params, version):
    self.published.append((params, version))
    self.store.publish(params, version)

  def wait_for(self, min_version, stop_event=None, timeout=None):
    return self.store.wait_for(min_version, stop_event=stop_event, timeout=timeout)


class KLBoard:

  def __init__(self):
    self.shared = {}

  def share(self, version, coef):
    self.shared[version] = coef

  def wait(self, version, stop):
    del stop
    return self.shared[version]


def in_process_channels():
  return PipeChannels(rollouts=BoundedQueue(2, "rollouts"),
                      experience=BoundedQueue(2, "experience"),
                      actor=VersionedWeights(), critic=VersionedWeights())


def cross_process_channels():
  return PipeChannels(rollouts=RemoteStream("rollouts"), experience=RemoteStream("experience"),
                      actor=RemoteWeights(), critic=RemoteWeights(), sync_in_step=False,
                      span_args={"process": "p0"}, carry_data_state=True, kl_coefs=KLBoard())


class Source:
  """Prompt batches with a resumable position."""

  def __init__(self):
    self.position = 0

  def __next__(self):
    self.position += 1
    return {"index": np.array([self.position - 1])}

  def get_state(self):
    return {"position": self.position}


def run_loop(system, channels):
  tracer, records, recorded_at = Tracer(), [], {}
  feed = DataFeed(Source())

  def on_step(step, metrics):
    records.append((step, metrics))
    recorded_at[step] = tracer.now()
    # The checkpoint of this step would resume from here.
    assert feed.state_before(step + 1) == {"position": step + 1}

  stopped = run_pipe_workers(system, feed, 0, STEPS, on_step, tracer, NeverStop(), channels,
                             timeout=120)
  assert not stopped
  return records, recorded_at, tracer


@pytest.mark.parametrize("across", [False, True], ids=["in_process", "cross_process"])
def test_one_loop_over_both_kinds_of_channels(across):
  system = FakeSystem()
  channels = cross_process_channels() if across else in_process_channels()
  records, recorded_at, tracer = run_loop(system, channels)
  assert [step for step, _ in records] == list(range(STEPS))
  for step, metrics in records:
    assert 0 <= metrics["staleness/actor"] <= 1 and metrics["time/step_s"] >= 0
    assert metrics["kl_coef"] == 0.1
    # What travels with a batch to its update is taken out there.
    assert not {"generate_version", "time/generate_start", "_data_state"} & set(metrics)
  # The staleness bound held, and the generator used the version it was granted.
  for step, params, version in system.generated_with:
    assert step - 1 <= version <= step and params.endswith(f"A{version}")
  syncs = {s.batch: s for s in tracer.spans("sync")}
  assert sorted(syncs) == list(range(STEPS))
  if across:
    # The trainer's own arrays are handed over, the critic before the actor of a version,
    # the KL coefficient of each version shared; the sync follows the step's record and
    # reports no transfer; every span names its process.
    assert channels.actor.published == [(f"A{v}", v) for v in range(STEPS + 1)]
    assert channels.critic.published == [(f"C{v}", v) for v in range(STEPS + 1)]
    assert channels.kl_coefs.shared == {v: 0.1 for v in range(STEPS + 1)}
    assert all(syncs[k].start >= recorded_at[k] for k in range(STEPS))
    assert not any(key.startswith("transfer/") for _, m in records for key in m)
    assert {s.args.get("process") for s in tracer.spans()} == {"p0"}
  else:
    # Resharded onto the consumers' layouts inside the step, before its record, which
    # reports the reshards; spans carry no process.
    assert all(syncs[k].end <= recorded_at[k] for k in range(STEPS))
    assert all(m["transfer/actor_sync/bytes"] == 8 and m["transfer/critic_sync/bytes"] == 4
               for _, m in records)
    assert all("queue/rollouts/num_put" in m for _, m in records)
    assert all("process" not in s.args for s in tracer.spans())


def test_a_stopped_stage_does_not_close_its_cross_process_output():
  # Generation fails at step 1: the inference worker, waiting for that batch, stops
  # without closing the experience stream, which a trainer in another process would read
  # as the end of the run.
  system = FakeSystem(fail_generate_at=1)
  channels = cross_process_channels()
  with pytest.raises(RuntimeError, match="generation failed at step 1") as info:
    run_loop(system, channels)
  assert any("generate" in note for note in info.value.__notes__)
  assert channels.rollouts.closes == 0 and channels.experience.closes == 0
