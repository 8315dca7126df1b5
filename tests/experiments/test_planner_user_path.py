"""experiments/planner_user_path.py's reading of a job's plan row and its page's verdict
(the runs themselves are the experiment's, not the tests')."""

import json
import types

import pytest

from experiments import planner_user_path as pup


def test_the_plan_row_is_read_and_a_missing_measurement_is_named(tmp_path):
  rows = [{"phase": "ppo", "step": 0},
          {"phase": "plan", "plan/predicted_step_s": 1.2, "plan/measured_step_s": 1.0}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert pup.plan_row(str(tmp_path))["plan/predicted_step_s"] == 1.2
  (tmp_path / "metrics.jsonl").write_text(json.dumps(
      {"phase": "plan", "plan/predicted_step_s": 1.2}) + "\n")
  with pytest.raises(SystemExit, match="has no measured plan row"):
    pup.plan_row(str(tmp_path))


def test_the_page_holds_the_goal_only_within_twenty_percent_and_flags_other_work():
  def row(mode, error, other=0.01):
    return {"mode": mode, "efficiencies": "calibrated", "predicted": 1.0 + error,
            "measured": 1.0, "error": error, "other": other, "seconds": 60.0}
  args = types.SimpleNamespace(config="configs/quickstart.py", steps=24)
  assert "holds (largest error 13%)" in pup.body([row("sequential", 0.13),
                                                  row("pipe", -0.06)], args)
  text = pup.body([row("sequential", -0.29, other=0.45)], args, calibrated_beside=None)
  assert "does NOT hold" in text and "45% of the cores (flagged)" in text
  assert "during the calibration: unknown" in text


def test_bad_modes_and_too_few_steps_are_refused():
  with pytest.raises(SystemExit, match="--modes: choose among"):
    pup.main(["--modes", "async"])
  with pytest.raises(SystemExit, match="--steps=3"):
    pup.main(["--steps", "3"])
