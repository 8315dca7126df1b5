"""The prepared accelerator check at its smoke size on a CPU: a row of finite figures for the
mode asked, and a page that carries the provenance block.

One mode runs (`per_stage`: its stages on their own meshes, with the weight sync that
`sequential` has not); every mode goes through the same per-mode function of the script,
and the modes themselves are compared in tests/system/."""

import json
import math
from pathlib import Path
import subprocess
import sys

import pytest

from tests.helpers.xla_env import child_env

ROOT = Path(__file__).resolve().parents[2]


# Extended: the accelerator script's CPU smoke run (its parts are the benchmarks' own,
# tested in their files).
@pytest.mark.long
@pytest.mark.slow
@pytest.mark.extended
def test_device_check_smoke_writes_finite_rows_per_mode_and_its_page(tmp_path):
  env = child_env()
  out = subprocess.run(
      [sys.executable, "-m", "experiments.device_check", "--smoke", "--modes", "per_stage",
       "--out-dir", str(tmp_path / "out"), "--page", "--page-dir", str(tmp_path / "page")],
      capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  rows = [json.loads(line) for line in
          (tmp_path / "out" / "smollm2-135m.jsonl").read_text().splitlines()]
  assert [r["mode"] for r in rows] == ["per_stage"]
  for row in rows:
    assert "error" not in row, row.get("error")
    assert row["dtype"] == "float32" and row["hardware"] == "cpu" and row["layers"] == 2
    for stage in ("generate", "infer", "train"):
      for key in ("s", "flops", "gflops", "peak_fraction", "bound_s"):
        value = row[f"{stage}_{key}"]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (stage, key)
    for key in ("step_s", "mfu", "decode_tokens_per_s", "decode_roofline_tokens_per_s",
                "decode_bandwidth_fraction", "planner_step_s", "planner_step_ratio",
                "planner_memory_mib", "xla_train_mib"):
      assert math.isfinite(row[key]) and row[key] > 0, key
  page = (tmp_path / "page" / "device_check.md").read_text()
  assert "f32 matmul peak" in page and "commit" in page and "command" in page
  assert "smollm2-135m" in page and "per_stage" in page and "`pipe` not run" in page
