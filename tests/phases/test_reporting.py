"""The run's report: the reward plot and the end-of-run summary, from the metrics log."""

import json
import os

import numpy as np
import pytest

from pipe_rlhf_jax import metrics as metrics_lib
from pipe_rlhf_jax.phases import reporting


def test_moving_average():
  x = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
  np.testing.assert_allclose(reporting.moving_average(x, 2),
                             [1.0, 1.5, 2.5, 3.5, 4.5])
  np.testing.assert_allclose(reporting.moving_average(x, 1), x)
  with pytest.raises(ValueError, match="window"):
    reporting.moving_average(x, 0)


def _write_rewards(workdir, rewards, t0=1000.0):
  lines = []
  for step, r in enumerate(rewards):
    lines.append(json.dumps({"step": step, "phase": "ppo", "time": t0 + step,
                             "reward/mean": r}))
  lines.append(json.dumps({"step": 0, "phase": "generate", "time": t0,
                           "reward/mean": 999.0}))
  (workdir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_plot_reward_curve(tmp_path):
  import matplotlib.image  # pylint: disable=g-import-not-at-top
  _write_rewards(tmp_path, [0.1 * i for i in range(20)])
  out = reporting.plot_reward_curve(
      tmp_path / "metrics.jsonl", tmp_path / "plots" / "reward.png")
  assert out == tmp_path / "plots" / "reward.png"
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  image = matplotlib.image.imread(out)
  assert image.shape[0] == 400 and image.shape[1] == 700
  with pytest.raises(ValueError, match="'kl'.*keys present: \\['reward/mean'\\]"):
    reporting.plot_reward_curve(tmp_path, tmp_path / "kl.png", key="kl")


def test_format_summary(tmp_path):
  _write_rewards(tmp_path, [float(i) for i in range(10)])
  text = reporting.format_summary(
      tmp_path, num_avg=3, checkpoint_dir=tmp_path / "ckpt",
      plot_path=tmp_path / "reward.png", export_dir=tmp_path / "hf")
  # Means of the first / last three ppo values; the generate record is ignored.
  assert "start 1.0000 -> end 8.0000" in text
  assert "change +7.0000" in text
  assert "wall time: 0:00:09" in text
  assert f"metrics: {tmp_path / 'metrics.jsonl'}" in text
  assert f"checkpoints: {tmp_path / 'ckpt'}" in text
  assert f"reward plot: {tmp_path / 'reward.png'}" in text
  assert f"exported model: {tmp_path / 'hf'}" in text
  records = metrics_lib.read_metrics(tmp_path)
  short = reporting.format_summary(records[:2], num_avg=5, wall_time_s=3725)
  assert "start 0.5000 -> end 0.5000" in short
  assert "wall time: 1:02:05" in short
  assert "not logged" in reporting.format_summary(records, key="kl")


def test_plotting_leaves_the_matplotlib_backend_alone(tmp_path):
  # A notebook's inline backend must survive a run: the library draws on the Agg canvas
  # object directly instead of switching the global backend (or touching pyplot). A
  # fresh process, because the backend is process-global state.
  import subprocess
  import sys
  _write_rewards(tmp_path, [0.1 * i for i in range(5)])
  code = (
      "import sys, matplotlib; matplotlib.use('svg')\n"
      "from pipe_rlhf_jax.phases import reporting\n"
      f"reporting.plot_reward_curve({str(tmp_path)!r}, {str(tmp_path / 'r.png')!r})\n"
      "assert matplotlib.get_backend() == 'svg', matplotlib.get_backend()\n"
      "assert 'matplotlib.pyplot' not in sys.modules\n")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                        cwd=os.path.join(os.path.dirname(__file__), "..", ".."))
  assert done.returncode == 0, done.stderr[-2000:]
  assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_drop_metrics_removes_rows_keeps_the_rest_verbatim(tmp_path):
  path = tmp_path / "metrics.jsonl"
  kept = ['{"step": 0, "phase": "sft", "time": 1.0, "loss": 2.5}\n',
          '{"step": 1, "phase": "ppo", "time": 2.0, "x": 0.1}\n']
  path.write_text(kept[0] + kept[1] + '{"step": 2, "phase": "ppo", "time": 3.0}\n'
                  + '{"step": 3, "phase": "pp')  # a write cut short by a crash
  removed = metrics_lib.drop_metrics(
      tmp_path, lambda r: r["phase"] == "ppo" and r["step"] >= 2)
  assert removed == 2  # step 2, and the broken last line (it would end up mid-file)
  assert path.read_text() == "".join(kept)
  assert not [p for p in os.listdir(tmp_path) if p != "metrics.jsonl"]  # no temp left
  assert metrics_lib.drop_metrics(tmp_path / "missing", lambda r: True) == 0
  path.write_text('not json\n{"step": 0, "phase": "ppo", "time": 1.0}\n')
  with pytest.raises(ValueError, match="line 1"):
    metrics_lib.drop_metrics(path, lambda r: True)
  assert path.read_text().startswith("not json")  # nothing changed
