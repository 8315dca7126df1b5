"""Tests for concurrency.weights: versioned publish/wait and the staleness bound."""

import threading
import time

import pytest

from pipe_rlhf_jax.concurrency.queues import BoundedQueue
from pipe_rlhf_jax.concurrency.weights import (
    StalenessGate,
    VersionedWeights,
    WeightsClosed,
    required_version,
)
from pipe_rlhf_jax.concurrency.workers import WorkerGroup


def test_required_version():
  assert required_version(0, 0) == 0
  assert required_version(5, 0) == 5
  assert required_version(5, 2) == 3
  assert required_version(1, 3) == 0
  with pytest.raises(ValueError, match="max_staleness"):
    required_version(2, -1)
  with pytest.raises(ValueError, match="batch_index"):
    required_version(-1, 0)


def test_publish_must_increase():
  w = VersionedWeights()
  with pytest.raises(LookupError):
    w.latest()
  assert w.publish("p0") == 0
  assert w.publish("p3", 3) == 3
  assert w.latest() == ("p3", 3)
  with pytest.raises(ValueError, match="strictly increase"):
    w.publish("again", 3)
  with pytest.raises(ValueError, match="strictly increase"):
    w.publish("older", 1)
  assert w.publish("next") == 4


def test_wait_for_blocks_until_published():
  w = VersionedWeights({"w": 0}, version=0)
  assert w.wait_for(0) == ({"w": 0}, 0)  # already satisfied: no wait

  def publisher():
    time.sleep(0.15)
    w.publish({"w": 1}, 1)

  t = threading.Thread(target=publisher, daemon=True)
  t.start()
  t0 = time.perf_counter()
  params, version = w.wait_for(1, timeout=60.0)
  waited = time.perf_counter() - t0
  t.join(30.0)
  assert (params, version) == ({"w": 1}, 1)
  assert 0.1 <= waited < 30.0  # woken by the publish, not by the timeout
  m = w.metrics()
  assert m["weights/num_waits"] == 2 and m["weights/num_blocked_waits"] == 1
  assert m["weights/wait_s"] >= 0.1


def test_wait_for_timeout_stop_and_close():
  w = VersionedWeights("p", version=0)
  with pytest.raises(TimeoutError, match="latest version is 0"):
    w.wait_for(1, timeout=0.1)

  stop = threading.Event()
  threading.Timer(0.1, stop.set).start()
  t0 = time.perf_counter()
  with pytest.raises(WeightsClosed):
    w.wait_for(1, stop_event=stop, timeout=60.0)
  assert time.perf_counter() - t0 < 30.0  # the stop ended the wait, not the timeout

  threading.Timer(0.1, w.close).start()
  with pytest.raises(WeightsClosed):
    w.wait_for(1, timeout=5.0)
  with pytest.raises(WeightsClosed):
    w.publish("late", 5)


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_async_generate_train_respects_staleness(max_staleness):
  """Generator runs ahead of a slow trainer by at most max_staleness versions."""
  n = 6
  weights = VersionedWeights("v0", version=0)
  gate = StalenessGate(weights, max_staleness)
  group = WorkerGroup(shutdown_timeout=3.0)
  rollouts = group.register_queue(BoundedQueue(4, "rollouts"))
  group.register_queue(weights)
  trained = []

  def generate(stop):
    for k in range(n):
      _, version = gate.acquire(k, stop_event=stop, timeout=5.0)
      rollouts.put((k, version), stop_event=stop)
    rollouts.close()

  def train(stop):
    for k, version in rollouts:
      time.sleep(0.03)
      trained.append((k, version))
      weights.publish(f"v{k + 1}", k + 1)

  group.add("generate", generate)
  group.add("train", train)
  assert group.run(timeout=10.0)
  assert [k for k, _ in trained] == list(range(n))
  lags = gate.lags()
  assert sorted(lags) == list(range(n))
  assert all(0 <= lag <= max_staleness for lag in lags.values())
  # The bound is tight: a fast generator uses the full allowance.
  assert max(lags.values()) == max_staleness
  assert weights.version == n
