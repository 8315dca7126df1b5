"""phases/heldout.py: the paired change of per-prompt greedy scores and its summary line."""

import numpy as np
import pytest

from pipe_rlhf_jax.phases import heldout


def test_paired_change_counts_prompts_and_bounds_the_mean_change():
  change = heldout.paired_change([1.0, 1.0, 0.0, 0.5], [1.0, 0.0, 1.0, 0.5])
  assert (change.delta, change.worse, change.better) == (0.0, 1, 1)
  assert change.low < 0.0 < change.high and not change.significantly_worse
  same = heldout.paired_change([0.25] * 8, [0.25] * 8)
  assert (same.delta, same.low, same.high, same.worse, same.better) == (0, 0, 0, 0, 0)
  # Half the prompts fell by 0.5 and none rose: every resample of the prompts falls.
  drop = heldout.paired_change([1.0] * 32, [0.5] * 16 + [1.0] * 16)
  assert drop.delta == -0.25 and drop.high < 0 and drop.significantly_worse
  assert -0.5 <= drop.low <= drop.high
  # The interval is reproducible (a fixed seed), and its seed is a parameter.
  assert heldout.paired_change([1.0] * 32, [0.5] * 16 + [1.0] * 16) == drop


def test_paired_change_refuses_unpaired_scores():
  with pytest.raises(ValueError, match="equally long"):
    heldout.paired_change([1.0, 0.0], [1.0])
  with pytest.raises(ValueError, match="non-empty"):
    heldout.paired_change([], [])


def test_summary_line_states_the_change_and_its_interval():
  before = heldout.GreedyEval([], {"rule": 0.75}, 4, {"rule": [1.0, 1.0, 0.0, 1.0]})
  after = heldout.GreedyEval([], {"rule": 0.5}, 4, {"rule": [1.0, 0.0, 0.0, 1.0]})
  line = heldout.summary_lines(before, after)["held-out greedy rule"]
  assert line.startswith("0.750 -> 0.500 (4 prompts; change -0.250, 95% interval [")
  assert line.endswith("1 worse / 0 better)")
  # Scores without per-prompt values (another caller's) keep the short line.
  short = heldout.summary_lines(heldout.GreedyEval([], {"rule": 0.75}, 4),
                                heldout.GreedyEval([], {"rule": 0.5}, 4))
  assert short == {"held-out greedy rule": "0.750 -> 0.500 (4 prompts)"}
  assert np.mean(before.per_prompt["rule"]) == before.scores["rule"]
