"""Tests for data/builders.py: array_record TFDS datasets built and read back without TF."""

import importlib.util
import json
import os
import sys

import pytest

from pipe_rlhf_jax.data.builders import build_dataset, make_task_datasets
from pipe_rlhf_jax.data.task import make_task_records


@pytest.fixture
def no_tensorflow():
  """Runs the test only where TensorFlow is absent, and checks nothing imported it.

  (Blocking an installed TF is not reliable: TFDS and etils probe for it with
  `find_spec` and take any "tensorflow" key in sys.modules to mean it is loaded.)
  """
  if importlib.util.find_spec("tensorflow") is not None:
    pytest.skip("TensorFlow is installed here; this test covers the TF-free path.")
  yield
  assert "tensorflow" not in sys.modules


def _write(path, lines):
  path.write_bytes(b"\n".join(lines) + b"\n")
  return str(path)


def test_build_and_read_back_without_tf(tmp_path, no_tensorflow):
  import tensorflow_datasets as tfds

  train = _write(tmp_path / "train.jsonl", [
      json.dumps({"prompt": "rev abc=", "chosen": "cba", "rejected": "cbb"}).encode(),
      json.dumps({"prompt": "rev ab=", "chosen": "ba"}).encode(),  # missing rejected
      b'{"prompt": "rev \xff=", "chosen": "a", "rejected": "b"}',  # invalid UTF-8
      json.dumps({"prompt": "rev é=", "chosen": "é", "rejected": "e", "extra": 1},
                 ensure_ascii=False).encode(),
  ])
  held = _write(tmp_path / "eval.jsonl", [
      json.dumps({"prompt": "rev hg=", "chosen": "gh", "rejected": "hg"}).encode()])
  built = build_dataset("prefs", {"train": train, "eval": held}, str(tmp_path / "tfds"),
                        name="toy_prefs")
  assert built.splits == {"train": 2, "eval": 1}
  assert built.stats["train"] == {"records/seen": 4, "records/kept": 2,
                                  "skipped/missing_field": 1, "skipped/invalid_utf8": 1}
  assert any(f.startswith("toy_prefs-train.array_record") for f in os.listdir(built.path))

  source = tfds.data_source("toy_prefs", data_dir=str(tmp_path / "tfds"), split="train")
  assert len(source) == 2
  first, second = source[0], source[1]
  assert first == {"index": 0, "prompt": b"rev abc=", "chosen": b"cba", "rejected": b"cbb"}
  assert second["index"] == 3 and second["prompt"].decode() == "rev é="
  assert "extra" not in second
  assert built.source("eval")[0]["chosen"] == b"gh"


def test_reuse_stale_and_errors(tmp_path):
  data_dir = str(tmp_path / "tfds")
  path = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "rev ab="}).encode()])
  first = build_dataset("prompts", path, data_dir, name="toy_prompts")
  assert first.splits == {"train": 1}
  # Same inputs: reused as is (the shard is not rewritten).
  shard = [f for f in os.listdir(first.path) if "array_record" in f][0]
  mtime = os.path.getmtime(os.path.join(first.path, shard))
  again = build_dataset("prompts", path, data_dir, name="toy_prompts")
  assert again == first and os.path.getmtime(os.path.join(first.path, shard)) == mtime
  # Changed inputs: refused without overwrite, rebuilt with it.
  _write(tmp_path / "p.jsonl", [json.dumps({"prompt": p}).encode() for p in ("rev ab=", "rev cd=")])
  with pytest.raises(ValueError, match="overwrite=True"):
    build_dataset("prompts", path, data_dir, name="toy_prompts")
  rebuilt = build_dataset("prompts", path, data_dir, name="toy_prompts", overwrite=True)
  assert rebuilt.splits == {"train": 2} and len(rebuilt.source("train")) == 2

  empty = _write(tmp_path / "bad.jsonl", [b'{"nope": 1}'])
  with pytest.raises(ValueError, match="No valid prompts records"):
    build_dataset("prompts", empty, data_dir, name="toy_empty")
  with pytest.raises(ValueError, match=r"bad\.jsonl:1: field 'prompt' is missing"):
    build_dataset("prompts", empty, data_dir, name="toy_empty", on_invalid="error")
  with pytest.raises(ValueError, match="kind"):
    build_dataset("images", path, data_dir)
  with pytest.raises(ValueError, match="snake_case"):
    build_dataset("prompts", path, data_dir, name="Bad-Name")
  with pytest.raises(FileNotFoundError):
    build_dataset("prompts", str(tmp_path / "absent.jsonl"), data_dir)


def test_rebuilding_an_edited_dataset_is_said(tmp_path, capsys):
  data_dir = str(tmp_path / "tfds")
  path = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "rev ab="}).encode()])
  build_dataset("prompts", path, data_dir, name="toy_prompts")
  build_dataset("prompts", path, data_dir, name="toy_prompts", overwrite=True)
  assert "its inputs changed" not in capsys.readouterr().out  # unchanged: reused
  _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "rev cd="}).encode()])
  build_dataset("prompts", path, data_dir, name="toy_prompts", overwrite=True)
  assert (f"dataset toy_prompts: its inputs changed since it was built ({path}); rebuilding "
          in capsys.readouterr().out)


def test_make_task_datasets(tmp_path, no_tensorflow):
  data_dir = str(tmp_path / "tfds")
  kw = dict(num_prompts=64, num_demos=48, num_pairs=40, num_eval=16)
  out = make_task_datasets(data_dir, seed=3, **kw)
  assert out["prompts"].name == "reverse_prompts"
  assert out["prompts"].splits == {"train": 64, "eval": 16}
  assert out["demos"].splits == {"train": 48}
  assert out["prefs"].splits == {"train": 40, "eval": 16}
  expected = make_task_records(64, 48, 40, 3, num_eval=16)
  demos = out["demos"].source("train")
  assert [{"prompt": demos[i]["prompt"].decode(), "completion": demos[i]["completion"].decode()}
          for i in range(len(demos))] == expected["demos"]
  # A different task config regenerates the JSONL and rebuilds the derived datasets.
  changed = make_task_datasets(data_dir, seed=4, **kw)
  assert changed["prompts"].fingerprint != out["prompts"].fingerprint
  prompts = changed["prompts"].source("train")
  first = make_task_records(64, 0, 0, 4, num_eval=16)["prompts"][0]["prompt"]
  assert prompts[0]["prompt"].decode() == first


def test_building_leaves_nothing_in_the_system_temp_dir(tmp_path, monkeypatch):
  # TFDS's first build of a dataset can leave a `tmp*tfds` folder in the temp dir (its
  # lookup of metadata published on the TFDS bucket), dozens per test run; ours must not.
  import tempfile
  temp = tmp_path / "system_temp"
  temp.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(temp))
  train = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "rev ab="}).encode()])
  build_dataset("prompts", train, str(tmp_path / "tfds"), name="toy_prompts_temp")
  assert os.listdir(temp) == []
