"""The simulator on hand-built cases whose step period is known in closed form."""

import pytest

from pipe_rlhf_jax.planner import simulator


def test_serial_period_is_the_sum():
  for mode in ("sequential", "per_stage"):
    r = simulator.simulate({"generate": 3.0, "infer": 1.0, "train": 2.0}, 0.5, mode, steps=6)
    assert r.step_time == pytest.approx(6.5)
    assert r.staleness == 0.0
    assert r.busy["generate"] == pytest.approx(3.0 / 6.5)
    assert len(r.tracer.spans("generate")) == 6


@pytest.mark.parametrize("times", [(3.0, 1.0, 1.0), (1.0, 4.0, 1.0), (1.0, 1.0, 2.5)])
def test_pipe_staleness_one_runs_at_the_bottleneck(times):
  # One stage dominates (max >= sum / 2): staleness 1 hides the other two entirely.
  g, i, t = times
  r = simulator.simulate({"generate": g, "infer": i, "train": t}, 0.0, "pipe",
                         max_staleness=1, steps=30)
  assert r.step_time == pytest.approx(max(times))
  # The bottleneck is busy all the time in steady state.
  assert max(r.busy.values()) == pytest.approx(1.0, abs=0.1)


def test_pipe_staleness_gate_bounds_the_period():
  # Equal stages: batch k's generation waits for the update of batch k - s - 1, so
  # (s + 1) periods cover the chain g + i + t + sync.
  times = {"generate": 1.0, "infer": 1.0, "train": 1.0}
  for s, expected in ((0, 3.5), (1, 1.75), (2, 1.5), (3, 1.5)):
    r = simulator.simulate(times, 0.5, "pipe", max_staleness=s, queue_size=4, steps=40)
    assert r.step_time == pytest.approx(expected), s
  r = simulator.simulate(times, 0.5, "pipe", max_staleness=0, steps=10)
  assert r.staleness == 0.0
  # Generation-bound: each rollout comes from the previous batch's update (staleness 1).
  r = simulator.simulate({"generate": 1.0, "infer": 0.1, "train": 0.1}, 0.0, "pipe",
                         max_staleness=2, steps=30)
  assert r.staleness == pytest.approx(1.0)
  # Training-bound: generation runs ahead up to the bound.
  r = simulator.simulate({"generate": 0.1, "infer": 0.1, "train": 1.0}, 0.0, "pipe",
                         max_staleness=2, queue_size=4, steps=30)
  assert r.staleness == pytest.approx(2.0)


def test_back_pressure_blocks_generation():
  # Training is 4x slower; the queues fill and generation waits, never running ahead more
  # than the queues (and the staleness bound) allow.
  r = simulator.simulate({"generate": 1.0, "infer": 1.0, "train": 4.0}, 0.0, "pipe",
                         max_staleness=100, queue_size=1, steps=20)
  assert r.step_time == pytest.approx(4.0)
  assert r.busy["generate"] == pytest.approx(0.25, abs=0.05)
  # Generation of batch k never starts before training took batch k - 3 (1 queued rollout,
  # 1 held by inference, 1 queued experience... bounded lag).
  starts = {s.batch: s.start for s in r.tracer.spans("generate")}
  trains = {s.batch: s.start for s in r.tracer.spans("train")}
  for k in range(5, 20):
    assert starts[k] >= trains[k - 4] - 1e-9


def test_shared_host_concurrency_adds_no_compute():
  times = {"generate": 2.0, "infer": 1.0, "train": 1.0}
  # Each stage can use the whole host alone: overlapping them gains nothing.
  r = simulator.simulate(times, 0.0, "pipe", max_staleness=1, shared_host=True, steps=30)
  assert r.step_time == pytest.approx(4.0)
  # Each stage alone uses a quarter of the host: they overlap at full speed.
  quarter = {s: 0.25 for s in ("generate", "infer", "train", "sync")}
  r = simulator.simulate(times, 0.0, "pipe", max_staleness=1, shared_host=True,
                         demands=quarter, steps=30)
  assert r.step_time == pytest.approx(2.0)


def test_exclusive_stages_never_run_together():
  # Generation 1 s, inference 1 s, training 2 s, staleness high enough to overlap all:
  # free, the period is the bottleneck (2 s); with inference and training exclusive
  # (multi-device programs that run one at a time) it is their sum (3 s), generation
  # still overlapping; with all three exclusive, the whole chain (4 s).
  times = {"generate": 1.0, "infer": 1.0, "train": 2.0}
  for exclusive, expected in ((frozenset(), 2.0), ({"infer", "train"}, 3.0),
                              ({"generate", "infer", "train"}, 4.0)):
    r = simulator.simulate(times, 0.0, "pipe", max_staleness=4, queue_size=4,
                           exclusive=exclusive, steps=30)
    assert r.step_time == pytest.approx(expected), exclusive
  # A waiting stage's span includes its wait (as a stage call that waits for its
  # program does): no two exclusive spans overlap in their working part, so the spans of
  # inference cover the training it waited for.
  r = simulator.simulate(times, 0.0, "pipe", max_staleness=4, queue_size=4,
                         exclusive={"infer", "train"}, steps=30)
  infer = sorted(r.tracer.spans("infer"), key=lambda s: s.start)[10:]
  assert all(s.duration >= 1.0 - 1e-9 for s in infer)


def test_gantt_draws_the_prediction(tmp_path):
  r = simulator.simulate({"generate": 1.0, "infer": 0.5, "train": 0.7}, 0.1, "pipe",
                         max_staleness=1, steps=8)
  r.tracer.gantt(str(tmp_path / "predicted.png"))
  assert (tmp_path / "predicted.png").stat().st_size > 0
  assert {"generate", "infer", "train", "sync"} <= set(r.tracer.stages())
