"""The LoRA benchmark at a smoke size: its row is finite, the adapters' sync moves less
than the whole actor's, and its page carries the provenance block."""

import json
import math
from pathlib import Path
import subprocess
import sys

import pytest

from tests.helpers.xla_env import child_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_lora_benchmark_writes_a_finite_row_and_its_page(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "experiments.bench_lora", "--shapes", "smollm2-135m",
       "--layers", "1", "--rank", "4", "--steps", "1", "--batch", "2", "--prompt-len", "8",
       "--new-tokens", "4", "--out-dir", str(tmp_path / "out"), "--page",
       "--page-dir", str(tmp_path / "page")],
      capture_output=True, text=True, timeout=600, env=child_env(), cwd=ROOT)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  row = json.loads((tmp_path / "out" / "smollm2-135m.jsonl").read_text().splitlines()[0])
  assert row["finite"]
  for key in ("step_s", "generate_s", "infer_s", "train_s", "planner_whole_mib",
              "planner_lora_mib", "sync_whole_s", "sync_adapters_s"):
    assert math.isfinite(row[key]) and row[key] > 0, key
  assert row["planner_lora_mib"] < row["planner_whole_mib"]
  # rank 4 on every projection of one layer, f32: what the adapters' sync moves.
  assert row["sync_adapters_bytes"] == 4 * row["adapter_params"] < row["sync_whole_bytes"]
  page = (tmp_path / "page" / "lora.md").read_text()
  assert "matmul peak" in page and "commit" in page and "its adapters" in page
