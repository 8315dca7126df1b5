"""experiments/project_paper_scale.py on a tiny grid: labelled projections, the chosen plan
is the fastest mode's, speed-ups are ratios of the modes' predicted step times."""

import csv
import importlib.util
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script():
  spec = importlib.util.spec_from_file_location(
      "project_paper_scale", os.path.join(ROOT, "experiments", "project_paper_scale.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def test_projection_grid_writes_labelled_tables(tmp_path):
  script = _script()
  rows, label = script.run(["llama2-7b"], ["h100:16", "tpu-v5p:8"], [128], "",
                           str(tmp_path))
  assert "PROJECTION" in label and "assumed defaults (no calibration)" in label
  assert len(rows) == 2
  for row in rows:
    steps = [row[f"{m}_step_s"] for m in script.MODES]
    assert row["step_s"] == min(steps) and math.isfinite(row["step_s"])
    assert row["pipe_over_sequential"] == pytest.approx(
        row["sequential_step_s"] / row["pipe_step_s"])
    assert row["pipe_over_per_stage"] == pytest.approx(
        row["per_stage_step_s"] / row["pipe_step_s"])
    assert row["tokens_per_s"] == pytest.approx(512 * 128 / row["step_s"])
    assert row["chosen_plan"].split("[")[0] == script.MODES[steps.index(min(steps))]
  with open(tmp_path / "projections.csv") as f:
    assert [r["hardware"] for r in csv.DictReader(f)] == ["h100", "tpu-v5p"]
  text = (tmp_path / "projections.md").read_text()
  assert text.startswith("# PROJECTIONS (not measured)") and "## llama2-7b" in text
  assert label in text


def test_a_model_that_fits_nowhere_is_reported_not_dropped(tmp_path):
  rows, _ = _script().run(["llama2-70b"], ["h100:8"], [128], "", str(tmp_path))
  assert rows[0]["chosen_plan"] == "does not fit" and math.isinf(rows[0]["step_s"])
  assert "| - |" in (tmp_path / "projections.md").read_text()
