"""The plan CLI ranks plans here (cpu) and projects for absent hardware (h100, llama2-7b)."""

import os
import subprocess
import sys

import pytest

from pipe_rlhf_jax.planner import space

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plan(tmp_path, *flags):
  out = tmp_path / "best.flags"
  result = subprocess.run(
      [sys.executable, "-m", "pipe_rlhf_jax.plan", "--config=configs/quickstart.py",
       f"--out={out}", "--top=3", *flags], cwd=ROOT, capture_output=True, text=True,
      timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  return result.stdout, out.read_text().split()


@pytest.mark.parametrize("flags,mode_line", [
    (("--hardware=cpu", "--devices=8"), "cpu x 8"),
    (("--hardware=h100", "--devices=64", "--model=llama2-7b", "--batch_size=512",
      "--minibatch_size=64", "--prompt_len=512", "--gen_len=512"), "h100 x 64"),
])
def test_cli_ranks_and_writes_the_best_plan(tmp_path, flags, mode_line):
  stdout, best = _plan(tmp_path, *flags)
  assert mode_line in stdout and " 1 " in stdout
  overrides = {}
  for flag in best:
    key, value = flag[len("--config."):].split("=", 1)
    overrides[key] = int(value) if value.lstrip("-").isdigit() else value
  plan = space.from_overrides(overrides)  # the written flags are a valid plan
  assert plan.mode in ("sequential", "per_stage", "pipe")
