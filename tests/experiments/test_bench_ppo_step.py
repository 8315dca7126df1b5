"""The PPO-step benchmark at a published shape (`--shapes`), at a smoke size: every field of
its rows is finite, and its page carries the provenance block and the goals table."""

import json
import math
from pathlib import Path
import subprocess
import sys

import pytest

from tests.helpers.xla_env import child_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_real_shapes_benchmark_writes_finite_rows_and_its_page(tmp_path):
  env = child_env()
  out = subprocess.run(
      [sys.executable, "-m", "experiments.bench_ppo_step",
       "--shapes", "smollm2-135m", "--layers", "2", "--steps", "1", "--batch", "2",
       "--prompt-len", "8", "--new-tokens", "4", "--out-dir", str(tmp_path / "out"),
       "--page", "--page-dir", str(tmp_path / "page")],
      capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  rows = [json.loads(line) for line in
          (tmp_path / "out" / "smollm2-135m.jsonl").read_text().splitlines()]
  assert len(rows) == 1
  row = rows[0]
  for stage in ("generate", "infer", "train"):
    for key in ("s", "flops", "gflops", "peak_fraction", "bound_s"):
      value = row[f"{stage}_{key}"]
      assert isinstance(value, float) and math.isfinite(value) and value > 0, (stage, key)
  for key in ("bound_s", "measured_over_bound", "peak_rss_mib", "planner_step_s",
              "planner_step_error", "planner_memory_mib", "memory_model_error",
              "planner_probed_step_s", "planner_probed_step_error"):
    assert math.isfinite(row[key]) and row[key] >= 0, key
  # Probed efficiencies are fractions of the measured peak and bandwidth.
  assert all(0 < v <= 1 for v in row["planner_probed_efficiency"].values())
  page = (tmp_path / "page" / "real_shapes.md").read_text()
  assert "matmul peak" in page and "commit" in page and "smollm2-135m" in page


def test_a_page_is_written_only_when_asked():
  from experiments.bench_ppo_step import parse_args
  assert parse_args([]).page is None
  assert parse_args(["--shapes", "smollm2-135m"]).page is None
  assert parse_args(["--page"]).page == "ppo_step"
  assert parse_args(["--shapes", "smollm2-135m", "--page"]).page == "real_shapes"
