"""Tests for concurrency.queues.BoundedQueue: ordering, close/stop semantics, back-pressure."""

import queue
import threading
import time

import pytest

from pipe_rlhf_jax.concurrency.queues import BoundedQueue, PipelineShutdown, QueueClosed


def _in_thread(fn):
  t = threading.Thread(target=fn, daemon=True)
  t.start()
  return t


def test_rejects_bad_maxsize():
  with pytest.raises(ValueError, match="maxsize"):
    BoundedQueue(0, "q")
  with pytest.raises(ValueError, match="maxsize"):
    BoundedQueue(1.5, "q")


def test_fifo_and_counters():
  q = BoundedQueue(3, "fifo")
  for i in range(3):
    q.put(i)
  assert q.qsize() == 3 and q.high_water == 3
  assert [q.get(), q.get(), q.get()] == [0, 1, 2]
  assert q.num_put == 3 and q.num_get == 3
  m = q.metrics()
  assert m["queue/fifo/high_water"] == 3.0 and m["queue/fifo/size"] == 0.0


def test_timeouts_raise_stdlib_exceptions_and_count_blocked_time():
  q = BoundedQueue(1, "t")
  t0 = time.perf_counter()
  with pytest.raises(queue.Empty):
    q.get(timeout=0.1)
  assert time.perf_counter() - t0 < 10.0  # it gave up (loose: a loaded host is slow)
  assert q.get_blocked_s >= 0.09
  q.put("x")
  with pytest.raises(queue.Full):
    q.put("y", timeout=0.1)
  assert q.put_blocked_s >= 0.09
  assert q.get() == "x"


def test_close_drains_then_raises():
  q = BoundedQueue(2, "c")
  q.put(1)
  q.put(2)
  q.close()
  assert q.closed
  with pytest.raises(QueueClosed):
    q.put(3)
  assert q.get() == 1 and q.get() == 2
  with pytest.raises(QueueClosed):
    q.get()
  assert issubclass(QueueClosed, PipelineShutdown)


def test_close_without_drain_discards():
  q = BoundedQueue(2, "abort")
  q.put(1)
  q.close(drain=False)
  with pytest.raises(QueueClosed):
    q.get(timeout=1.0)


def test_iteration_stops_at_close():
  q = BoundedQueue(4, "it")
  for i in range(3):
    q.put(i)
  q.close()
  assert list(q) == [0, 1, 2]


@pytest.mark.parametrize("how", ["close", "stop_event", "per_call_stop"])
def test_blocked_get_wakes_promptly(how):
  stop = threading.Event()
  q = BoundedQueue(1, "w", stop_event=stop if how == "stop_event" else None)
  call_stop = threading.Event()
  result = {}

  def consumer():
    t0 = time.perf_counter()
    try:
      q.get(stop_event=call_stop if how == "per_call_stop" else None)
    except QueueClosed as e:
      result["exc"] = e
    result["waited"] = time.perf_counter() - t0

  t = _in_thread(consumer)
  time.sleep(0.1)
  assert "waited" not in result  # really blocked
  {"close": q.close, "stop_event": stop.set, "per_call_stop": call_stop.set}[how]()
  t.join(30.0)
  assert not t.is_alive()
  assert isinstance(result["exc"], QueueClosed)
  assert result["waited"] < 30.0  # woken by the close or stop, not left blocked


def test_blocked_put_wakes_on_stop():
  stop = threading.Event()
  q = BoundedQueue(1, "p", stop_event=stop)
  q.put(0)
  result = {}

  def producer():
    try:
      q.put(1)
    except QueueClosed as e:
      result["exc"] = e

  t = _in_thread(producer)
  time.sleep(0.1)
  stop.set()
  t.join(30.0)
  assert not t.is_alive() and isinstance(result["exc"], QueueClosed)
  # Stop means halt now: even queued items are no longer handed out.
  with pytest.raises(QueueClosed):
    q.get()


def test_back_pressure_bounds_producer_lead():
  maxsize, n = 1, 12
  q = BoundedQueue(maxsize, "bp")
  processed = [0]
  leads = []

  def producer():
    for i in range(n):
      q.put(i)
      # Items put but not yet fully processed by the consumer.
      leads.append(q.num_put - processed[0])
    q.close()

  def consumer():
    for _ in q:
      time.sleep(0.01)  # slower than the producer
      processed[0] += 1

  ts = [_in_thread(producer), _in_thread(consumer)]
  for t in ts:
    t.join(5.0)
  assert not any(t.is_alive() for t in ts)
  assert processed[0] == n
  assert max(leads) <= maxsize + 1
  assert q.high_water == maxsize
  assert q.put_blocked_s > 0.05  # the fast producer was held back
