"""Tests for the pure delayed inter-batch pipeline schedule."""

import itertools

import numpy as np
import pytest

from pipe_rlhf_jax.generation import schedule as sched

GRID = list(itertools.product([1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3]))


def test_p2_m2_t2_by_hand():
  # W = 2; ticks = 2*2 + 1 = 5.
  expected = np.array([
      # stage0    stage1
      [[0, 0], [-1, -1]],
      [[1, 0], [0, 0]],
      [[0, 1], [1, 0]],
      [[1, 1], [0, 1]],
      [[-1, -1], [1, 1]],
  ], dtype=np.int32)
  got = sched.delayed_schedule(2, 2, 2)
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, expected)


def test_m_less_than_p_has_bubbles_by_hand():
  # P=3, M=1, T=2: W=3, the ring holds one micro-batch and two bubbles.
  # Trailing all-bubble ticks are trimmed: (T-1)*W + M + P - 1 = 6 ticks.
  got = sched.delayed_schedule(3, 1, 2)
  assert got.shape == (6, 3, 2)
  stage0 = [tuple(x) for x in got[:, 0]]
  assert stage0 == [(0, 0), (-1, -1), (-1, -1), (0, 1), (-1, -1), (-1, -1)]
  stage2 = [tuple(x) for x in got[:, 2]]
  assert stage2 == [(-1, -1)] * 2 + [(0, 0), (-1, -1), (-1, -1), (0, 1)]
  assert sched.utilization(got) == pytest.approx(1 / 3)
  # P=4, M=2, T=2: W=4, ticks = 4 + 2 + 3 = 9; bubbles at ring slots 2 and 3.
  got = sched.delayed_schedule(4, 2, 2)
  assert got.shape == (9, 4, 2)
  assert [tuple(x) for x in got[:, 0]] == (
      [(0, 0), (1, 0), (-1, -1), (-1, -1), (0, 1), (1, 1)] + [(-1, -1)] * 3)
  assert [tuple(x) for x in got[:, 3]] == (
      [(-1, -1)] * 3 + [(0, 0), (1, 0), (-1, -1), (-1, -1), (0, 1), (1, 1)])


def test_p3_m4_t1_by_hand():
  got = sched.delayed_schedule(3, 4, 1)
  # ticks = 1*4 + 2 = 6; stage s runs mb t - s.
  assert got.shape == (6, 3, 2)
  for t in range(6):
    for s in range(3):
      mb = t - s
      want = (mb, 0) if 0 <= mb < 4 else (-1, -1)
      assert tuple(got[t, s]) == want


@pytest.mark.parametrize("p,m,t", GRID)
def test_delayed_properties(p, m, t):
  table = sched.delayed_schedule(p, m, t)
  w = max(m, p)
  ticks = (t - 1) * w + m + p - 1
  if m >= p:
    assert ticks == t * w + p - 1
  assert table.shape == (ticks, p, 2)
  assert sched.num_ticks(p, m, t) == ticks
  # The last tick is busy (no trailing all-bubble ticks) and so is the first.
  assert table[-1, p - 1, 0] == m - 1 and table[-1, p - 1, 1] == t - 1
  assert tuple(table[0, 0]) == (0, 0)
  for s in range(p):
    items = [tuple(x) for x in table[:, s] if x[0] >= 0]
    assert len(items) == m * t
    assert sorted(items) == sorted(itertools.product(range(m), range(t)))
  sched.check_dependencies(table)
  assert sched.utilization(table) == pytest.approx(
      sched.theoretical_utilization(p, m, t), abs=1e-12)
  naive = sched.naive_schedule(p, m, t)
  assert naive.shape[0] == m * t * p == sched.num_ticks(p, m, t, kind="naive")
  sched.check_dependencies(naive)
  assert sched.utilization(naive) == pytest.approx(1.0 / p)
  assert sched.utilization(table) >= sched.utilization(naive) - 1e-12
  busy0 = np.nonzero(table[:, 0, 0] >= 0)[0]
  gaps = (np.diff(busy0) > 1).any()
  # Stage 0 idles mid-run exactly when the ring is padded (M < P, T > 1).
  assert gaps == (m < p and t > 1)


def test_full_ring_approaches_full_utilization():
  u = sched.utilization(sched.delayed_schedule(4, 8, 64))
  assert u == pytest.approx(64 * 8 / (64 * 8 + 3))
  assert u > 0.99


def test_closed_form_matches_table():
  p, m, t = 3, 2, 4
  table = sched.delayed_schedule(p, m, t)
  ticks = np.arange(table.shape[0])[:, None]
  stages = np.arange(p)[None, :]
  mb, k, active = sched.delayed_slot(ticks, stages, p, m, t)
  np.testing.assert_array_equal(active, table[..., 0] >= 0)
  np.testing.assert_array_equal(mb[active], table[..., 0][active])
  np.testing.assert_array_equal(k[active], table[..., 1][active])


def test_ring_narrower_than_stages_violates_token_dependency():
  # Same formula with W = M < P: stage 0 would need a token not yet sampled.
  p, m, t = 3, 2, 2
  w = m
  ticks = t * w + p - 1
  table = np.full((ticks, p, 2), -1, np.int32)
  for tick in range(ticks):
    for s in range(p):
      u = tick - s
      if 0 <= u < t * w:
        table[tick, s] = (u % w, u // w)
  with pytest.raises(sched.ScheduleError, match="token is not back"):
    sched.check_dependencies(table)


def test_check_dependencies_catches_stage_order_and_duplicates():
  table = sched.delayed_schedule(2, 2, 1).copy()
  # Swap stage 1's work before stage 0's.
  bad = table.copy()
  bad[:, 1] = -1
  bad[0, 1] = (0, 0)
  bad[1, 1] = (1, 0)
  with pytest.raises(sched.ScheduleError, match="not after stage 0"):
    sched.check_dependencies(bad)
  dup = table.copy()
  dup[2, 0] = (0, 0)
  with pytest.raises(sched.ScheduleError, match="twice"):
    sched.check_dependencies(dup)
  missing = table.copy()
  missing[1, 1] = -1
  with pytest.raises(sched.ScheduleError, match="never processes"):
    sched.check_dependencies(missing)


def test_bad_sizes_raise():
  with pytest.raises(ValueError, match="num_microbatches"):
    sched.delayed_schedule(2, 0, 3)
  with pytest.raises(ValueError, match="num_stages"):
    sched.naive_schedule(-1, 2, 3)


def test_draw_schedule_writes_png(tmp_path):
  out = sched.draw_schedule(sched.delayed_schedule(4, 2, 3), tmp_path / "sub" / "s.png",
                            title="P=4 M=2 T=3")
  data = open(out, "rb").read()
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  assert len(data) > 1000
  big = sched.draw_schedule(sched.naive_schedule(4, 4, 8), tmp_path / "naive.png")
  assert open(big, "rb").read()[:4] == b"\x89PNG"


def test_validate_pipeline_config():
  sched.validate_pipeline_config(8, 4, 2, 16, "stages.generate")
  with pytest.raises(ValueError, match=r"stages\.generate\.mesh\.pipeline = 3 does not divide"):
    sched.validate_pipeline_config(8, 3, 2, 16, "stages.generate")
  with pytest.raises(ValueError, match=r"stages\.generate\.num_microbatches"):
    sched.validate_pipeline_config(8, 4, 0, 16, "stages.generate")
  with pytest.raises(ValueError, match=r"stages\.generate\.batch_size = 10 .*pad the batch"):
    sched.validate_pipeline_config(8, 4, 4, 10, "stages.generate")


def test_early_exit_ticks_by_hand():
  # P=2, M=2, T=5: W=2, 11 ticks in full, the first 3 the prefill block.
  assert sched.early_exit_ticks(2, 2, 5, [5, 5]) == sched.num_ticks(2, 2, 5) == 11
  # Micro-batch 1 needs 3 passes: stage 1 finishes it at tick 2*2 + 1 + 1 = 6, so two
  # chunks of 2 decode ticks after the prefill block: 3 + 4.
  assert sched.early_exit_ticks(2, 2, 5, [2, 3]) == 7
  assert sched.early_exit_ticks(2, 2, 5, [2, 3], chunk_ticks=3) == 9
  # Everything done in the prefill: the decode loop still runs its first chunk.
  assert sched.early_exit_ticks(2, 2, 5, [1, 1]) == 5
  with pytest.raises(ValueError, match="passes must give 1..5 passes"):
    sched.early_exit_ticks(2, 2, 5, [6, 1])


@pytest.mark.parametrize("p, m, t", [(1, 1, 4), (2, 2, 5), (4, 2, 3), (3, 6, 4)])
def test_early_exit_schedule_runs_only_the_needed_passes(p, m, t):
  full = sched.delayed_schedule(p, m, t)
  np.testing.assert_array_equal(sched.early_exit_schedule(p, m, t, [t] * m), full)
  passes = [1 + (mb * 7) % t for mb in range(m)]
  table = sched.early_exit_schedule(p, m, t, passes)
  for mb, n in enumerate(passes):
    for s in range(p):
      ran = table[:, s][table[:, s, 0] == mb][:, 1]
      assert sorted(ran) == list(range(n))  # passes 0..n-1 once each, on every stage
  assert len(table) == sched.early_exit_ticks(p, m, t, passes) <= len(full) + max(m, p)


def test_refill_schedule_by_hand():
  # P=2, M=2 (W=2), loads needing 2, 1, 3 passes. Stage 0: tick 0 prefills load 0 into
  # micro-batch 0, tick 1 load 1 into micro-batch 1, tick 2 runs load 0's pass 1, tick
  # 3 refills micro-batch 1 (load 1 ended at its prefill) with load 2, whose passes
  # 1 and 2 run at ticks 5 and 7; stage 1 runs each a tick later.
  table = sched.refill_schedule(2, 2, [2, 1, 3])
  stage0 = [tuple(x) for x in table[:, 0]]
  assert stage0 == [(0, 0), (1, 0), (0, 1), (1, 0), (-1, -1), (1, 1), (-1, -1), (1, 2),
                    (-1, -1)]
  np.testing.assert_array_equal(table[1:, 1], table[:-1, 0])


@pytest.mark.parametrize("p, m, t", [(1, 1, 4), (2, 2, 5), (4, 2, 3), (3, 6, 4)])
def test_refill_schedule_without_refills_is_the_early_exit_schedule(p, m, t):
  passes = [1 + (mb * 7) % t for mb in range(m)]
  table = sched.refill_schedule(p, m, passes)
  early = sched.early_exit_schedule(p, m, t, passes)
  np.testing.assert_array_equal(early[:len(table)], table)
  assert (early[len(table):] == sched.BUBBLE).all()


@pytest.mark.parametrize("p, m", [(2, 2), (4, 2), (2, 4)])
def test_refill_schedule_runs_every_load_and_keeps_the_bound(p, m):
  rs = np.random.RandomState(p * 10 + m)
  t = 9
  passes = rs.randint(1, t + 1, size=5 * m)
  table = sched.refill_schedule(p, m, passes)
  assert len(table) <= sched.refill_ticks_bound(p, m, len(passes), t)
  stage0 = table[:, 0]
  # Prefills hand out the loads in queue order, each to a micro-batch that is free.
  prefills = np.flatnonzero(stage0[:, 1] == 0)
  assert len(prefills) == len(passes)
  assert int((stage0[:, 0] >= 0).sum()) == int(passes.sum())  # every pass, once
  # Busy slots: fewer idle ticks than the static batches of the same loads in turn.
  static = sum(len(sched.early_exit_schedule(p, m, t, passes[i:i + m]))
               for i in range(0, len(passes), m))
  assert len(table) < static


def test_tick_activity_by_hand():
  # P=2, M=2, T=2 (see test_p2_m2_t2_by_hand): prefills at ticks 0-2, decodes 2-4.
  activity = sched.tick_activity(sched.delayed_schedule(2, 2, 2))
  np.testing.assert_array_equal(activity, [[1, 0], [2, 0], [1, 1], [0, 2], [0, 1]])
