"""The response-length model: a constant EOS hazard cut at T, its mean, the expected
longest of r rows (against sampling), and the fraction read from a run's metrics."""

import json

import numpy as np
import pytest

from pipe_rlhf_jax.planner import lengths, space


@pytest.mark.parametrize("fraction, max_len", [(0.5, 16), (0.1, 512), (0.9, 128)])
def test_hazard_gives_the_asked_mean(fraction, max_len):
  q = lengths.hazard(fraction, max_len)
  mean = (1 - (1 - q) ** max_len) / q
  assert mean / max_len == pytest.approx(fraction, rel=1e-9)
  # One row's expected longest is its mean.
  assert lengths.expected_longest(fraction, max_len, 1) == pytest.approx(mean, rel=1e-9)


def test_expected_longest_matches_sampling():
  rng = np.random.default_rng(0)
  q = lengths.hazard(0.25, 64)
  rows = np.minimum(rng.geometric(q, size=(20000, 16)), 64)  # [trials, rows]
  assert rows.mean() / 64 == pytest.approx(0.25, rel=0.02)
  assert lengths.expected_longest(0.25, 64, 16) == pytest.approx(rows.max(1).mean(),
                                                                 rel=0.01)


def test_no_early_eos_and_bad_fractions():
  assert lengths.expected_longest(1.0, 32, 8) == 32
  assert lengths.passes_per_microbatch(1.0, 32, 64, 4) == (32, 32, 32, 32)
  each, *_, last = lengths.passes_per_microbatch(0.3, 32, 64, 4)
  assert each < last <= 32  # the whole batch's longest row outlasts a micro-batch's
  with pytest.raises(ValueError, match=r"response_fraction=0 must be a number in \(0, 1\]"):
    space.Workload(actor=None, batch_size=1, minibatch_size=1, epochs=1, prompt_len=1,
                   gen_len=1, num_devices=1, response_fraction=0)


def test_fraction_from_a_runs_metrics(tmp_path):
  path = tmp_path / "metrics.jsonl"
  rows = [{"phase": "sft", "step": 0, "loss": 1.0},
          {"phase": "ppo", "step": 0, "response_length/mean": 3.0},
          {"phase": "ppo", "step": 1, "response_length/mean": 5.0}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert lengths.fraction_from_metrics(str(path), 8) == pytest.approx(0.5)
  path.write_text(json.dumps(rows[0]) + "\n")
  with pytest.raises(ValueError, match="no PPO rows with response_length/mean"):
    lengths.fraction_from_metrics(str(path), 8)
