"""The safetensors file format, read and written without torch, checked as it is read.

This module owns the bytes: one `.safetensors` file (an 8-byte little-endian header
length, a JSON header naming each tensor's dtype, shape and byte range, then the data
section), the `model.safetensors.index.json` that spreads a checkpoint over shards, and
the directory rule of which of the two a checkpoint is read from. What the tensors
mean is `models/hf.py`'s concern.

A damaged file never turns into a numpy error: a short file, a header length past the
end, a header that is not JSON, an unknown dtype, byte ranges that do not match the
shape, overlap, or run past the end of the file each raise ValueError naming the file
and, where one is at fault, the tensor. An index is refused when a shard name is
absolute or leaves the checkpoint directory, or when a shard lacks a tensor the index
assigns to it. When a directory holds both `model.safetensors` and an index, the single
file is read, as Hugging Face does.

bf16 tensors are read and written through `ml_dtypes`, so they load whatever numpy and
safetensors versions are installed.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path, PurePosixPath, PureWindowsPath
import struct
import sys
from typing import Any, Callable, Iterable, Mapping

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype codes <-> numpy dtypes (bf16 via ml_dtypes).
ST_TO_NP = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
NP_TO_ST = {v: k for k, v in ST_TO_NP.items()}
# The reference implementation refuses headers above 100 MB; a larger length is damage.
_MAX_HEADER_BYTES = 100 * 1024 * 1024
if sys.byteorder != "little":
  raise ImportError("pipe_rlhf_jax.models.safetensors_io reads safetensors bytes in place "
                    "and needs a little-endian host.")


def _read_header(path: Path, file_size: int) -> tuple[dict[str, Any], int]:
  """(the parsed header, the byte offset where the data section starts)."""
  with open(path, "rb") as f:
    prefix = f.read(8)
    if len(prefix) < 8:
      raise ValueError(f"{path}: the file has {file_size} bytes, fewer than the 8 of the "
                       f"header length: it is truncated or not a safetensors file.")
    (size,) = struct.unpack("<Q", prefix)
    if size > file_size - 8 or size > _MAX_HEADER_BYTES:
      raise ValueError(f"{path}: header length {size} runs past the end of the file "
                       f"({file_size} bytes): it is truncated or not a safetensors file.")
    raw = f.read(size)
  try:
    header = json.loads(raw)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: the header is not valid JSON ({e}): the file is damaged "
                     f"or not a safetensors file.") from e
  if not isinstance(header, dict):
    raise ValueError(f"{path}: the header is a JSON {type(header).__name__}, not an "
                     f"object of tensors.")
  return header, 8 + size


def _tensor_entry(path: Path, name: str, info: Any, data_size: int
                  ) -> tuple[np.dtype, tuple[int, ...], int, int]:
  """(dtype, shape, start, end) of one header entry, each checked against the file."""
  if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
    raise ValueError(f"{path}: tensor {name!r} has header entry {info!r}; it needs "
                     f"dtype, shape and data_offsets.")
  if info["dtype"] not in ST_TO_NP:
    raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, not one of "
                     f"{sorted(ST_TO_NP)}.")
  dt = ST_TO_NP[info["dtype"]]
  shape, offsets = info["shape"], info["data_offsets"]
  if (not isinstance(shape, list) or
      not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)):
    raise ValueError(f"{path}: tensor {name!r} has shape {shape!r}, not a list of "
                     f"non-negative integers.")
  if (not isinstance(offsets, list) or len(offsets) != 2 or
      not all(isinstance(n, int) and not isinstance(n, bool) for n in offsets) or
      not 0 <= offsets[0] <= offsets[1]):
    raise ValueError(f"{path}: tensor {name!r} has data_offsets {offsets!r}, not a pair "
                     f"0 <= start <= end.")
  start, end = offsets
  if end > data_size:
    raise ValueError(f"{path}: tensor {name!r} data_offsets [{start}, {end}] run past the "
                     f"end of the file (its data section holds {data_size} bytes): the "
                     f"file is truncated.")
  if end - start != math.prod(shape) * dt.itemsize:
    raise ValueError(f"{path}: tensor {name!r} byte range {end - start} does not match "
                     f"shape {tuple(shape)} of {info['dtype']}.")
  return dt, tuple(shape), start, end


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """Reads every tensor of a .safetensors file into numpy (bf16 as ml_dtypes.bfloat16).

  Args:
    path: the file.

  Returns:
    Tensor name -> array (a copy, not a view of the file).

  Raises:
    ValueError: the file is truncated or damaged; the message names the file and the
      tensor at fault.
  """
  path = Path(path)
  file_size = path.stat().st_size
  header, base = _read_header(path, file_size)
  data_size = file_size - base
  entries = {name: _tensor_entry(path, name, info, data_size)
             for name, info in header.items() if name != "__metadata__"}
  # Byte ranges must not share bytes: damage can leave each entry well formed alone.
  spans = sorted((start, end, name) for name, (_, _, start, end) in entries.items()
                 if end > start)
  for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
    if start_b < end_a:
      raise ValueError(f"{path}: the byte ranges of tensors {a!r} and {b!r} overlap: the "
                       f"header is damaged.")
  data = np.memmap(path, dtype=np.uint8, mode="r") if data_size else None
  out = {}
  for name, (dt, shape, start, end) in entries.items():
    if end == start:
      out[name] = np.zeros(shape, dt)
      continue
    # Copy out of the memmap; safetensors is little-endian, as is every host we run on.
    out[name] = np.array(data[base + start:base + end]).view(dt).reshape(shape)
  del data
  return out


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
  """Writes numpy tensors (bf16 included) in the safetensors format."""
  specs = []
  for name in sorted(tensors):
    arr = np.asarray(tensors[name])
    specs.append((name, arr.shape, arr.dtype))
  write_safetensors_lazy(path, specs, lambda name: tensors[name], metadata)


def write_safetensors_lazy(path: str | os.PathLike,
                           specs: Iterable[tuple[str, tuple[int, ...], Any]],
                           make: Callable[[str], np.ndarray],
                           metadata: Mapping[str, str] | None = None) -> int:
  """Writes a safetensors file whose tensors are produced one at a time.

  The header is laid out from `specs` first, then `make(name)` is called per tensor and
  its bytes written before the next is made, so a file of any size is written holding
  one tensor in memory.

  Args:
    path: the output file.
    specs: (name, shape, dtype) per tensor, in the order they are laid out.
    make: name -> the tensor's array, of exactly that shape and dtype.
    metadata: the header's `__metadata__` (default {"format": "pt"}, which transformers
      expects).

  Returns:
    Bytes of tensor data written.
  """
  specs = [(name, tuple(shape), np.dtype(dtype)) for name, shape, dtype in specs]
  header: dict[str, Any] = {}
  offset = 0
  for name, shape, dtype in specs:
    if dtype not in NP_TO_ST:
      raise ValueError(f"tensor {name!r} has dtype {dtype}; cannot store it.")
    nbytes = math.prod(shape) * dtype.itemsize
    header[name] = {"dtype": NP_TO_ST[dtype], "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  header["__metadata__"] = dict(metadata or {"format": "pt"})
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the format aligns the data section to 8 bytes
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name, shape, dtype in specs:
      arr = np.ascontiguousarray(make(name))
      if arr.shape != shape or arr.dtype != dtype:
        raise ValueError(f"tensor {name!r}: made {arr.shape} {arr.dtype}, the header says "
                         f"{shape} {dtype}.")
      f.write(arr.tobytes())
  return offset


def write_index(directory: str | os.PathLike, weight_map: Mapping[str, str],
                total_size: int) -> Path:
  """Writes `model.safetensors.index.json` (tensor name -> shard file name)."""
  path = Path(directory) / INDEX_FILE
  index = {"metadata": {"total_size": int(total_size)},
           "weight_map": dict(sorted(weight_map.items()))}
  path.write_text(json.dumps(index, indent=2) + "\n")
  return path


def _shard_path(directory: Path, index: Path, shard: Any) -> Path:
  """The shard file an index names, refused unless it is a path inside `directory`."""
  if not isinstance(shard, str) or not shard:
    raise ValueError(f"{index}: shard name {shard!r} is not a file name.")
  posix, windows = PurePosixPath(shard), PureWindowsPath(shard)
  # Lexical, not resolved: hub caches link shards to blobs elsewhere, which is fine;
  # a name that itself climbs out or is absolute is not.
  if (posix.is_absolute() or windows.is_absolute() or windows.drive or
      ".." in posix.parts or ".." in windows.parts):
    raise ValueError(f"{index}: shard {shard!r} lies outside the checkpoint directory "
                     f"{directory}; shard names must be relative paths inside it.")
  return directory / posix


def _read_index(index: Path) -> dict[str, str]:
  try:
    parsed = json.loads(index.read_text())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{index} is not valid JSON ({e}).") from e
  weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
  if not isinstance(weight_map, dict) or not weight_map:
    raise ValueError(f"{index} has no weight_map object (tensor name -> shard file).")
  return weight_map


def load_checkpoint_tensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """Every tensor of a checkpoint directory: `model.safetensors`, else the index's shards.

  Raises:
    FileNotFoundError: neither file is there.
    ValueError: a damaged file or index (see the module docstring).
  """
  path = Path(path)
  single, index = path / SINGLE_FILE, path / INDEX_FILE
  if single.exists():
    return read_safetensors(single)
  if not index.exists():
    raise FileNotFoundError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE} (torch "
                            f".bin checkpoints are not read; re-save them with "
                            f"safe_serialization=True).")
  weight_map = _read_index(index)
  shards: dict[str, list[str]] = {}
  for name, shard in weight_map.items():
    shards.setdefault(shard, []).append(name)
  tensors: dict[str, np.ndarray] = {}
  for shard in sorted(shards, key=str):
    file = _shard_path(path, index, shard)
    if not file.exists():
      raise FileNotFoundError(f"{index} lists shard {shard!r}, but {file} does not exist.")
    contents = read_safetensors(file)
    lacking = sorted(set(shards[shard]) - set(contents))
    if lacking:
      raise ValueError(f"{index} assigns tensor(s) {lacking[:5]} to {shard}, which does "
                       f"not hold them: the index and its shards disagree.")
    for name, value in contents.items():
      if name in tensors:
        raise ValueError(f"tensor {name!r} appears in more than one shard.")
      tensors[name] = value
  return tensors
