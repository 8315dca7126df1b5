"""Search finds the known optimum of small spaces (brute force: simulate every plan)."""

import dataclasses

import numpy as np
import pytest

from pipe_rlhf_jax.models.config import tiny_config
from pipe_rlhf_jax.planner import cost, hardware, search, space

WORK = space.Workload(actor=tiny_config(), batch_size=16, minibatch_size=8, epochs=1,
                      prompt_len=16, gen_len=8, num_devices=4)
OPTIONS = space.SpaceOptions(staleness=(0, 1, 2), train_remat=("none", "full"))


@pytest.mark.parametrize("hw", ["cpu", "h100", "tpu-v5e"])
def test_branch_and_bound_equals_simulating_every_plan(hw):
  m = cost.Machine(hardware.get(hw))
  best, _ = search.exhaustive(WORK, m, OPTIONS, k=3)
  brute, _ = search.exhaustive(WORK, m, OPTIONS, k=3, simulate_all=True)
  assert [c.step_time for c in best] == pytest.approx([c.step_time for c in brute])
  assert best[0].plan == brute[0].plan


@pytest.mark.parametrize("hw", ["h100", "tpu-v5e"])
def test_pareto_finds_the_brute_force_optimum(hw):
  work = dataclasses.replace(WORK, num_devices=8)
  m = cost.Machine(hardware.get(hw))
  brute, _ = search.exhaustive(work, m, OPTIONS, k=1, simulate_all=True)
  best, _ = search.pareto(work, m, OPTIONS, k=1, coarse=False)
  assert best[0].step_time == pytest.approx(brute[0].step_time)


def test_memory_limit_rejects_with_a_reason():
  tiny_hbm = dataclasses.replace(hardware.get("h100"), hbm_bytes=2e6)
  best, rejected = search.exhaustive(WORK, cost.Machine(tiny_hbm), OPTIONS, k=3)
  assert rejected and all("GiB per device" in c.rejected for c in rejected)
  for c in best:
    assert max(c.memory.values()) <= 2e6 * 0.9


def test_the_search_chooses_continuous_batching_for_long_tailed_lengths():
  # One device, sequential: the space holds static batches and 1/2, 1/4 of the batch as
  # slots; on a long tail the engine wins, on uniform lengths nothing is offered.
  rs = np.random.RandomState(0)
  tail = tuple(int(x) for x in np.clip(np.round(24 * rs.lognormal(0, 0.894, 256)), 1, 256))
  work = space.Workload(actor=tiny_config(), batch_size=64, minibatch_size=64, epochs=1,
                        prompt_len=16, gen_len=256, num_devices=1, response_lengths=tail)
  m = cost.Machine(hardware.get("cpu"), cost.Efficiency())
  opts = space.SpaceOptions(modes=("sequential",))
  best = search.search(work, m, opts, k=1)[0][0].plan
  assert best.generate.num_slots in (16, 32)
  assert work.slot_counts(1) == (0, 32, 16)
  assert dataclasses.replace(work, response_lengths=()).slot_counts(1) == (0,)
