"""Damaged or tampered checkpoint files fail loudly, naming the file and the tensor.

Each case starts from a valid checkpoint written by `save_pretrained` and breaks one
thing the way a cut download, a bad disk or a hand-edited index does.
"""

import json
import re
import shutil
import struct

import numpy as np
import pytest

from pipe_rlhf_jax.models import hf
from pipe_rlhf_jax.models.config import TransformerConfig
from pipe_rlhf_jax.models.transformer import init_model

CONFIG = TransformerConfig(vocab_size=40, embed_dim=32, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8, mlp_dim=48)


@pytest.fixture
def ckpt(tmp_path):
  """A valid tiny LLaMA checkpoint directory (config.json + model.safetensors)."""
  path = tmp_path / "ckpt"
  hf.save_pretrained(init_model(CONFIG), path)
  return path


def _header(file):
  raw = file.read_bytes()
  (size,) = struct.unpack("<Q", raw[:8])
  return json.loads(raw[8:8 + size]), raw[8 + size:]


def _write_header(file, header, data):
  blob = json.dumps(header).encode()
  blob += b" " * (-len(blob) % 8)
  file.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def _last_tensor(header):
  """The tensor whose bytes end the data section."""
  tensors = {k: v for k, v in header.items() if k != "__metadata__"}
  return max(tensors, key=lambda k: tensors[k]["data_offsets"][1])


def test_truncated_data_names_file_and_tensor(ckpt):
  file = ckpt / "model.safetensors"
  header, _ = _header(file)
  last = _last_tensor(header)
  file.write_bytes(file.read_bytes()[:-100])
  with pytest.raises(ValueError, match=rf"model\.safetensors.*{re.escape(last)}.*past the end"):
    hf.from_pretrained(ckpt)


def test_header_length_past_end_of_file(ckpt):
  file = ckpt / "model.safetensors"
  file.write_bytes(file.read_bytes()[:40])  # the length prefix and part of the header
  with pytest.raises(ValueError, match=r"model\.safetensors.*header length \d+ .*40 bytes"):
    hf.from_pretrained(ckpt)


def test_file_shorter_than_length_prefix(ckpt):
  file = ckpt / "model.safetensors"
  file.write_bytes(b"\x00\x01\x02")
  with pytest.raises(ValueError, match=r"model\.safetensors.*3 bytes"):
    hf.from_pretrained(ckpt)


def test_header_not_json(ckpt):
  file = ckpt / "model.safetensors"
  raw = bytearray(file.read_bytes())
  raw[8:12] = b"\xff\xfe{["  # the first bytes of the JSON header
  file.write_bytes(bytes(raw))
  with pytest.raises(ValueError, match=r"model\.safetensors.*header is not valid JSON"):
    hf.from_pretrained(ckpt)


def test_unknown_dtype_names_file_and_tensor(ckpt):
  file = ckpt / "model.safetensors"
  header, data = _header(file)
  header["model.norm.weight"]["dtype"] = "F12"
  _write_header(file, header, data)
  with pytest.raises(ValueError,
                     match=r"model\.safetensors.*'model\.norm\.weight'.*dtype F12"):
    hf.from_pretrained(ckpt)


def test_overlapping_tensors(ckpt):
  file = ckpt / "model.safetensors"
  header, data = _header(file)
  # Two tensors of one shape made to share bytes: each alone looks well formed.
  a, b = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight"
  header[a]["data_offsets"] = list(header[b]["data_offsets"])
  _write_header(file, header, data)
  with pytest.raises(ValueError, match=r"model\.safetensors.*overlap"):
    hf.from_pretrained(ckpt)


def _shard(ckpt, shard_name, index_dir=None):
  """Moves model.safetensors to `shard_name` (relative to the directory) + an index."""
  index_dir = index_dir or ckpt
  tensors = hf.read_safetensors(ckpt / "model.safetensors")
  target = ckpt / shard_name
  target.parent.mkdir(parents=True, exist_ok=True)
  shutil.move(ckpt / "model.safetensors", target)
  (index_dir / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {}, "weight_map": {name: shard_name for name in tensors}}))
  return tensors


@pytest.mark.parametrize("kind", ["parent", "absolute"])
def test_index_shard_outside_the_directory_is_refused(ckpt, kind):
  outside = ckpt.parent / "elsewhere.safetensors"
  shutil.move(ckpt / "model.safetensors", outside)
  tensors = hf.read_safetensors(outside)
  name = "../elsewhere.safetensors" if kind == "parent" else str(outside)
  (ckpt / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {}, "weight_map": {t: name for t in tensors}}))
  with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json.*elsewhere"
                                       r"\.safetensors.*outside"):
    hf.from_pretrained(ckpt)


def test_index_shard_in_a_subdirectory_loads(ckpt):
  tensors = _shard(ckpt, "weights/part-1.safetensors")
  model = hf.from_pretrained(ckpt)
  np.testing.assert_array_equal(np.asarray(model.final_norm.get_value()),
                                tensors["model.norm.weight"])


def test_single_file_preferred_over_index(ckpt):
  single = hf.read_safetensors(ckpt / "model.safetensors")
  # A stale index next to the file, naming a shard that holds other values.
  stale = {k: v + 1 for k, v in single.items()}
  hf.write_safetensors(ckpt / "model-00001-of-00001.safetensors", stale)
  (ckpt / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors"
                                      for k in single}}))
  model = hf.from_pretrained(ckpt)
  np.testing.assert_array_equal(np.asarray(model.final_norm.get_value()),
                                single["model.norm.weight"])


def test_index_names_a_tensor_its_shard_lacks(ckpt):
  tensors = hf.read_safetensors(ckpt / "model.safetensors")
  names = sorted(tensors)
  hf.write_safetensors(ckpt / "a.safetensors", {k: tensors[k] for k in names[:5]})
  hf.write_safetensors(ckpt / "b.safetensors", {k: tensors[k] for k in names[5:]})
  (ckpt / "model.safetensors").unlink()
  weight_map = {k: "a.safetensors" if i < 5 else "b.safetensors" for i, k in enumerate(names)}
  weight_map[names[0]] = "b.safetensors"  # the index disagrees with the files
  (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  with pytest.raises(ValueError, match=rf"{re.escape(names[0])}.*b\.safetensors"):
    hf.from_pretrained(ckpt)


def test_index_not_json(ckpt):
  _shard(ckpt, "model-00001-of-00001.safetensors")
  index = ckpt / "model.safetensors.index.json"
  index.write_text(index.read_text()[:30])
  with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json"):
    hf.from_pretrained(ckpt)


def test_index_without_weight_map(ckpt):
  _shard(ckpt, "model-00001-of-00001.safetensors")
  (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
  with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json.*weight_map"):
    hf.from_pretrained(ckpt)
