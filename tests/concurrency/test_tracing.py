"""Tests for concurrency.tracing: span bookkeeping, overlap maths, Chrome JSON and Gantt output."""

import json
import threading
import time

import pytest

from pipe_rlhf_jax.concurrency.queues import BoundedQueue
from pipe_rlhf_jax.concurrency.tracing import Tracer
from pipe_rlhf_jax.concurrency.workers import WorkerGroup


def test_busy_fraction_and_overlap_exact():
  tr = Tracer()
  tr.add("a", 0.0, 1.0, batch=0)
  tr.add("a", 2.0, 3.0, batch=1)
  tr.add("b", 0.5, 2.5, batch=0)
  assert tr.overlap("a", "b") == pytest.approx(1.0)
  assert tr.overlap("b", "a") == pytest.approx(1.0)
  frac = tr.busy_fraction()
  assert frac == pytest.approx({"a": 2.0 / 3.0, "b": 2.0 / 3.0})
  assert tr.busy_fraction(window=(0.0, 1.0)) == pytest.approx({"a": 1.0, "b": 0.5})
  s = tr.summary()
  assert s["wall_s"] == pytest.approx(3.0)
  assert s["stages"]["a"]["count"] == 2
  assert s["stages"]["b"]["busy_s"] == pytest.approx(2.0)
  assert s["overlap_s"]["a|b"] == pytest.approx(1.0)


def test_same_stage_spans_are_unioned():
  tr = Tracer()
  tr.add("a", 0.0, 1.0)
  tr.add("a", 0.5, 1.5)
  tr.add("b", 0.0, 2.0)
  assert tr.summary()["stages"]["a"]["busy_s"] == pytest.approx(1.5)
  assert tr.overlap("a", "b") == pytest.approx(1.5)
  assert tr.overlap("a", "missing") == 0.0


def test_span_context_records_even_on_error():
  tr = Tracer()
  with tr.span("train", batch=2, version=1, lr=0.1) as args:
    args["loss"] = 0.5
  with pytest.raises(ZeroDivisionError):
    with tr.span("train", batch=3):
      1 / 0
  spans = tr.spans("train")
  assert [s.batch for s in spans] == [2, 3]
  assert spans[0].version == 1 and spans[0].args == {"lr": 0.1, "loss": 0.5}
  assert spans[1].args["error"] == "ZeroDivisionError"
  assert spans[0].thread == threading.current_thread().name
  assert all(s.end >= s.start for s in spans)


def test_add_validation_and_disabled_tracer():
  tr = Tracer()
  with pytest.raises(ValueError, match="ends before"):
    tr.add("x", 1.0, 0.5)
  off = Tracer(enabled=False)
  with off.span("x", batch=0):
    pass
  assert off.add("x", 0.0, 1.0) is None
  assert off.spans() == []


def test_thread_safe_recording():
  tr = Tracer()

  def record(i):
    for j in range(200):
      tr.add(f"s{i}", j, j + 0.5, batch=j)

  ts = [threading.Thread(target=record, args=(i,)) for i in range(4)]
  for t in ts:
    t.start()
  for t in ts:
    t.join(5.0)
  assert len(tr.spans()) == 800
  assert sorted(tr.stages()) == ["s0", "s1", "s2", "s3"]


def _run_fake_stages(tracer, concurrent, n=3, step_s=0.05):
  """generate -> queue -> train, each step a sleep of `step_s`."""
  if not concurrent:
    for k in range(n):
      with tracer.span("generate", batch=k, version=0):
        time.sleep(step_s)
      with tracer.span("train", batch=k, version=k + 1):
        time.sleep(step_s)
    return
  group = WorkerGroup(shutdown_timeout=3.0)
  q = BoundedQueue(1, "rollouts")

  def generate(stop):
    for k in range(n):
      with tracer.span("generate", batch=k, version=0):
        time.sleep(step_s)
      q.put(k, stop_event=stop)
    q.close()

  def train(stop):
    for k in q:
      with tracer.span("train", batch=k, version=k + 1):
        time.sleep(step_s)

  group.add("generate", generate)
  group.add("train", train)
  assert group.run(timeout=10.0)


def test_concurrent_stages_overlap_and_outputs_parse(tmp_path):
  tr = Tracer()
  _run_fake_stages(tr, concurrent=True)
  assert tr.overlap("generate", "train") > 0.0
  assert len(tr.spans("generate")) == 3 and len(tr.spans("train")) == 3

  path = tr.to_chrome_trace(tmp_path / "trace" / "run.json")
  with open(path) as f:
    trace = json.load(f)
  events = trace["traceEvents"]
  complete = [e for e in events if e["ph"] == "X"]
  assert len(complete) == 6
  names = {e["tid"]: e["args"]["name"] for e in events
           if e["ph"] == "M" and e["name"] == "thread_name"}
  assert sorted(names.values()) == ["generate", "train"]
  for e in complete:
    assert names[e["tid"]] == e["cat"]  # one row (tid) per stage
    assert 0.04e6 <= e["dur"] < 10e6  # microseconds (nanoseconds would be ~5e7)
    assert "batch" in e["args"] and "version" in e["args"]
  assert sorted(e["args"]["batch"] for e in complete if e["cat"] == "train") == [0, 1, 2]

  png = tr.gantt(tmp_path / "gantt.png", title="fake async PPO")
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  import matplotlib.image
  img = matplotlib.image.imread(png)
  assert img.ndim == 3 and img.shape[0] > 50 and img.shape[1] > 200


def test_serial_stages_do_not_overlap():
  tr = Tracer()
  _run_fake_stages(tr, concurrent=False)
  assert tr.overlap("generate", "train") == 0.0
  frac = tr.busy_fraction()
  assert frac["generate"] + frac["train"] <= 1.0 + 1e-9


def test_overlap_restricted_to_a_window():
  from pipe_rlhf_jax.concurrency.tracing import Tracer
  tracer = Tracer()
  tracer.add("generate", 0.0, 4.0, batch=0)
  tracer.add("train", 1.0, 3.0, batch=0)
  tracer.add("train", 5.0, 6.0, batch=1)
  assert tracer.overlap("generate", "train") == pytest.approx(2.0)
  assert tracer.overlap("generate", "train", (2.5, 10.0)) == pytest.approx(0.5)
  assert tracer.busy_fraction((4.0, 6.0))["train"] == pytest.approx(0.5)


def test_lanes_are_rows_of_the_trace_and_stay_out_of_the_stage_accounting(tmp_path):
  tracer = Tracer()
  tracer.add("generate", 0.0, 4.0, batch=0)
  tracer.add("train", 4.0, 6.0, batch=0)
  for slot, (lo, hi) in ((10, (0.0, 1.0)), (2, (0.5, 3.0)), (2, (3.0, 4.0))):
    tracer.add_lane("generate", f"slot {slot}", lo, hi, batch=0, completion=slot)
  assert tracer.stages() == ["generate", "train"]
  assert tracer.summary()["stages"]["generate"]["count"] == 1
  with pytest.raises(ValueError, match="slot 1 ends before it starts"):
    tracer.add_lane("generate", "slot 1", 2.0, 1.0)
  events = json.load(open(tracer.to_chrome_trace(tmp_path / "t.json")))["traceEvents"]
  rows = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
  # Each stage's lanes sit just below it, in lane order ("slot 2" before "slot 10").
  assert [rows[t] for t in sorted(rows)] == ["generate", "generate slot 2",
                                              "generate slot 10", "train"]
  bars = [e for e in events if e.get("ph") == "X" and rows[e["tid"]] == "generate slot 2"]
  assert [(b["ts"], b["dur"]) for b in bars] == [(0.5e6, 2.5e6), (3.0e6, 1.0e6)]
  assert all(b["cat"] == "generate" and b["args"]["completion"] == 2 for b in bars)
  disabled = Tracer(enabled=False)
  disabled.add_lane("generate", "slot 0", 0.0, 1.0)
  assert disabled.lanes() == []
