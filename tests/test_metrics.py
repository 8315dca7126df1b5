"""Tests for pipe_rlhf_jax.metrics: JSON lines, TensorBoard, plots, summary."""

import importlib.util
import io
import json
import logging
import struct
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipe_rlhf_jax import metrics as metrics_lib
from pipe_rlhf_jax.metrics import MetricsWriter


def _strict_json(line):
  def reject(const):
    raise ValueError(f"non-standard JSON constant {const}")
  return json.loads(line, parse_constant=reject)


def _read_tensorboard_scalars(logdir):
  """Parses tensorboardX event files (TFRecord framing) into {tag: [(step, v)]}."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  out = {}
  files = sorted(logdir.glob("events.out.tfevents.*"))
  assert files, f"no event file in {logdir}"
  for path in files:
    data = path.read_bytes()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      payload = data[pos + 12:pos + 12 + length]
      pos += 12 + length + 4
      event = event_pb2.Event.FromString(payload)
      for value in event.summary.value:
        out.setdefault(value.tag, []).append((event.step, value.simple_value))
  return out


def test_to_python_flattens_and_uses_one_device_get(monkeypatch):
  calls = []
  real_device_get = jax.device_get

  def counting_device_get(x):
    calls.append(x)
    return real_device_get(x)

  monkeypatch.setattr(jax, "device_get", counting_device_get)
  tree = {
      "reward": {"mean": jnp.float32(0.5), "std": jnp.array([2.0])},
      "kl": jnp.asarray(0.25, jnp.bfloat16),
      "count": np.int64(3),
      "lr": 1e-4,
  }
  out = metrics_lib.to_python(tree)
  assert len(calls) == 1
  assert out == {"reward/mean": 0.5, "reward/std": 2.0, "kl": 0.25,
                 "count": 3.0, "lr": 1e-4}
  assert all(type(v) is float for v in out.values())


def test_to_python_rejects_non_scalars():
  with pytest.raises(ValueError, match="'loss' has shape \\(3,\\)"):
    metrics_lib.to_python({"loss": jnp.ones(3)})
  with pytest.raises(TypeError, match="mapping"):
    metrics_lib.to_python([1.0])


def test_writer_jsonl_and_tensorboard(tmp_path):
  with MetricsWriter(tmp_path) as writer:
    for step in range(3):
      writer.write(step, {"reward/mean": jnp.float32(step * 0.5),
                          "kl": np.float64(0.1 * step)})
    writer.write(7, {"tokens_per_s": 100.0}, phase="generate")
  records = metrics_lib.read_metrics(tmp_path)
  assert [r["step"] for r in records] == [0, 1, 2, 7]
  assert [r["phase"] for r in records] == ["ppo"] * 3 + ["generate"]
  assert [r["reward/mean"] for r in records[:3]] == [0.0, 0.5, 1.0]
  assert records[3]["tokens_per_s"] == 100.0
  assert all(isinstance(r["time"], float) for r in records)
  assert records == metrics_lib.read_metrics(tmp_path / "metrics.jsonl")

  scalars = _read_tensorboard_scalars(tmp_path / "tensorboard")
  assert [s for s, _ in scalars["ppo/reward/mean"]] == [0, 1, 2]
  np.testing.assert_allclose([v for _, v in scalars["ppo/reward/mean"]],
                             [0.0, 0.5, 1.0])
  np.testing.assert_allclose([v for _, v in scalars["ppo/kl"]],
                             [0.0, 0.1, 0.2], rtol=1e-6)
  assert scalars["generate/tokens_per_s"] == [(7, 100.0)]


def test_non_finite_written_as_null(tmp_path, caplog):
  with caplog.at_level(logging.WARNING, logger=metrics_lib.__name__):
    with MetricsWriter(tmp_path) as writer:
      rec = writer.write(1, {"loss": jnp.nan, "kl": np.inf, "ok": 1.0})
  assert rec["loss"] is None and rec["kl"] is None and rec["ok"] == 1.0
  assert rec[metrics_lib.NONFINITE_KEY] == ["kl", "loss"]
  line = (tmp_path / "metrics.jsonl").read_text().strip()
  parsed = _strict_json(line)  # no NaN / Infinity tokens in the file
  assert parsed["loss"] is None
  assert "non-finite" in caplog.text
  # TensorBoard still gets the raw value, so the spike shows in its plots.
  scalars = _read_tensorboard_scalars(tmp_path / "tensorboard")
  assert np.isnan(scalars["ppo/loss"][0][1]) and scalars["ppo/ok"] == [(1, 1.0)]


def test_reserved_names_and_closed_writer(tmp_path):
  writer = MetricsWriter(tmp_path, use_tensorboard=False)
  assert writer.tensorboard_dir is None
  with pytest.raises(ValueError, match="reserved"):
    writer.write(0, {"step": 1.0})
  writer.close()
  writer.close()  # idempotent
  assert not (tmp_path / "tensorboard").exists()
  with pytest.raises(ValueError, match="closed"):
    writer.write(0, {"x": 1.0})


def test_appends_on_resume(tmp_path):
  with MetricsWriter(tmp_path, use_tensorboard=False) as w:
    w.write(0, {"x": 1.0})
  with MetricsWriter(tmp_path, use_tensorboard=False) as w:
    w.write(1, {"x": 2.0})
  assert [r["x"] for r in metrics_lib.read_metrics(tmp_path)] == [1.0, 2.0]


def test_concurrent_writes_keep_lines_intact(tmp_path):
  writer = MetricsWriter(tmp_path, use_tensorboard=False)

  def work(phase):
    for step in range(50):
      writer.write(step, {"v": float(step)}, phase=phase)

  threads = [threading.Thread(target=work, args=(p,)) for p in ("a", "b", "c")]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  writer.close()
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 150
  records = [_strict_json(line) for line in lines]
  for phase in "abc":
    assert [r["step"] for r in records if r["phase"] == phase] == list(range(50))


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None,
                    reason="checks the fallback when wandb is absent")
def test_wandb_missing_warns_and_continues(tmp_path, caplog):
  with caplog.at_level(logging.WARNING, logger=metrics_lib.__name__):
    with MetricsWriter(tmp_path, use_tensorboard=False, use_wandb=True,
                       wandb_project="p", config={"a": 1}) as writer:
      writer.write(0, {"x": 1.0})
  assert "wandb" in caplog.text
  assert metrics_lib.read_metrics(tmp_path)[0]["x"] == 1.0


def test_read_metrics_truncated_last_line_and_corrupt_middle(tmp_path):
  path = tmp_path / "metrics.jsonl"
  good = json.dumps({"step": 0, "phase": "ppo", "time": 0.0, "x": 1.0})
  path.write_text(good + "\n" + good[:10])
  assert len(metrics_lib.read_metrics(path)) == 1
  path.write_text(good + "\n" + good[:10] + "\n" + good + "\n")
  with pytest.raises(ValueError, match="line 2"):
    metrics_lib.read_metrics(path)
  with pytest.raises(FileNotFoundError):
    metrics_lib.read_metrics(tmp_path / "nope.jsonl")


@pytest.mark.parametrize("disable", [True, False])
def test_progress_bar(disable, monkeypatch):
  stream = io.StringIO()
  monkeypatch.setattr("sys.stderr", stream)
  with metrics_lib.ProgressBar(5, "ppo", disable=disable) as bar:
    bar.update({"reward/mean": jnp.float32(0.5), "kl": 0.125, "other": 9.0})
    bar.update(n=2)
  assert bar.n == 3
  assert bar.postfix == {"reward/mean": 0.5, "kl": 0.125}
  if not disable:
    assert "reward/mean=0.5" in stream.getvalue()
    assert "kl=0.125" in stream.getvalue()
    assert "3/5" in stream.getvalue()
