"""A random-weight Hugging Face model directory of a published shape, written offline.

This module owns the writer behind benchmarks, tests and dry runs that want a real
model's shape without a download: `write_random_checkpoint` lays out, for a shape of
`models/shapes.py`,
- `config.json` as `models.hf.save_pretrained` writes it (so transformers and
  `models.hf.from_pretrained` both load it);
- `model.safetensors`, or shards of at most `max_shard_bytes` with a
  `model.safetensors.index.json`: matrices drawn from N(0, 0.02^2), norm weights one,
  biases zero, each tensor from its own seeded stream (the values do not depend on how
  the file is sharded) and written one tensor at a time, so a 7B model is written in
  the memory of its largest tensor;
- a tokenizer (`tokenizer.json` + `tokenizer_config.json`, built with the `tokenizers`
  library): byte-level BPE without merges (one token per UTF-8 byte), the shape's special
  tokens at their published ids, and unreachable filler tokens up to the model's
  vocabulary size, so that `vocab_size` of the tokenizer equals the model's and every id
  the config names is a token. Chat shapes get a ChatML `chat_template`.

The text such a tokenizer produces is not the published tokenizer's (it is one token
per byte); the ids of the special tokens and the vocabulary size are.

Command line (see `--help`):
  python -m pipe_rlhf_jax.models.random_checkpoint --shape qwen3-0.6b --out /tmp/qwen3
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import sys
from typing import Any, Mapping, Sequence
import zlib

import numpy as np

from pipe_rlhf_jax.models import hf, hf_config, shapes
from pipe_rlhf_jax.models.config import DTYPES, TransformerConfig, dtype_name
from pipe_rlhf_jax.models.safetensors_io import (
  INDEX_FILE,
  SINGLE_FILE,
  write_index,
  write_safetensors_lazy,
)

INIT_STD = 0.02
DEFAULT_MAX_SHARD_BYTES = 4 * 1024 ** 3
# The ChatML message format (role and content between <|im_start|> and <|im_end|>).
CHAT_TEMPLATES = {
    "chatml": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' "
               "+ message['content'] + '<|im_end|>\\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
}


def _tensor(name: str, shape: tuple[int, ...], dtype: np.dtype, seed: int) -> np.ndarray:
  """One tensor's initial value: norms one, biases zero, matrices N(0, INIT_STD^2)."""
  if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
    return np.ones(shape, dtype)
  if name.endswith(".bias"):
    return np.zeros(shape, dtype)
  rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
  value = rng.standard_normal(shape, dtype=np.float32)
  value *= INIT_STD
  return value.astype(dtype)


def _shard_plan(specs: Sequence[tuple[str, tuple[int, ...], np.dtype]],
                max_shard_bytes: int) -> list[list[tuple[str, tuple[int, ...], np.dtype]]]:
  """Consecutive tensors grouped into shards of at most `max_shard_bytes` (a larger
  tensor gets a shard of its own)."""
  shards: list[list] = [[]]
  size = 0
  for spec in specs:
    nbytes = int(np.prod(spec[1])) * spec[2].itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(spec)
    size += nbytes
  return shards


def write_weights(config: TransformerConfig, out: Path, *, seed: int, dtype: str,
                  max_shard_bytes: int) -> list[str]:
  """Writes the random tensors of `config` into `out`; returns the file names."""
  np_dtype = np.dtype(DTYPES[dtype])  # bf16: ml_dtypes' numpy dtype
  tensor_shapes = hf.hf_tensor_shapes(config)
  specs = [(name, shape, np_dtype) for name, shape in tensor_shapes.items()]
  plan = _shard_plan(specs, max_shard_bytes)
  make = lambda name: _tensor(name, tensor_shapes[name], np_dtype, seed)
  if len(plan) == 1:
    write_safetensors_lazy(out / SINGLE_FILE, plan[0], make)
    return [SINGLE_FILE]
  names, weight_map, total = [], {}, 0
  for i, shard in enumerate(plan, 1):
    file = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
    total += write_safetensors_lazy(out / file, shard, make)
    weight_map.update({name: file for name, _, _ in shard})
    names.append(file)
  write_index(out, weight_map, total)
  return names + [INDEX_FILE]


def write_tokenizer(shape: shapes.Shape, vocab_size: int, max_positions: int,
                    out: Path) -> list[str]:
  """Writes a byte-level tokenizer of exactly `vocab_size` tokens for `shape`.

  Special tokens take their published ids, the 256 byte symbols the lowest free ids, and
  filler tokens (never produced by encoding: there are no merges) every id left.
  """
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers

  specials = dict(shape.special_tokens)
  bad = {t: i for t, i in specials.items() if not 0 <= i < vocab_size}
  if bad:
    raise ValueError(f"special tokens {bad} of {shape.source} do not fit vocab_size="
                     f"{vocab_size}; keep the vocabulary at least "
                     f"{max(specials.values()) + 1}.")
  byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
  if vocab_size < len(byte_symbols) + len(specials):
    raise ValueError(f"vocab_size={vocab_size} cannot hold the {len(byte_symbols)} byte "
                     f"tokens and {len(specials)} special tokens.")
  taken = set(specials.values())
  free = (i for i in range(vocab_size) if i not in taken)
  vocab = dict(specials)
  for symbol in byte_symbols:
    vocab[symbol] = next(free)
  for i in free:
    vocab[f"<filler_{i}>"] = i
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                          for t in sorted(specials, key=specials.get)])
  if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
    raise RuntimeError(f"built a tokenizer of {tok.get_vocab_size()} tokens, wanted "
                       f"{vocab_size}")  # a bug here, never a silent mismatch
  tok.save(str(out / "tokenizer.json"))
  side: dict[str, Any] = {
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": shape.bos_token,
      "eos_token": shape.eos_token, "pad_token": shape.pad_token,
      "model_max_length": max_positions, "clean_up_tokenization_spaces": False,
      "add_bos_token": shape.bos_token is not None,
  }
  if shape.chat_format:
    side["chat_template"] = CHAT_TEMPLATES[shape.chat_format]
  (out / "tokenizer_config.json").write_text(json.dumps(side, indent=2) + "\n")
  return ["tokenizer.json", "tokenizer_config.json"]


def write_random_checkpoint(shape: str, out: str | os.PathLike, *, seed: int = 0,
                            dtype: Any = "bfloat16",
                            overrides: Mapping[str, Any] | None = None,
                            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                            overwrite: bool = False) -> TransformerConfig:
  """Writes a random-weight Hugging Face directory of a published shape.

  Args:
    shape: a name of `models.shapes.SHAPES`.
    out: the directory (created; refused when it already holds files, unless
      `overwrite`).
    seed: seed of the weights.
    dtype: storage dtype of the tensors and `torch_dtype` of the config.
    overrides: config.json size fields to change (e.g. a 2-layer variant for tests);
      see `models.shapes.hf_config`.
    max_shard_bytes: shard size above which the weights are split over several files.
    overwrite: write into a non-empty directory.

  Returns:
    The TransformerConfig the directory loads as (f32 compute).
  """
  dtype = dtype_name(dtype)
  out = Path(out)
  if out.exists() and any(out.iterdir()) and not overwrite:
    raise FileExistsError(f"{out} is not empty; pick a new directory or pass overwrite.")
  out.mkdir(parents=True, exist_ok=True)
  spec = shapes.get(shape)
  config = hf_config.config_from_hf(shapes.hf_config(shape, **dict(overrides or {})))
  for stale in (SINGLE_FILE, INDEX_FILE):  # a previous layout must not shadow this one
    (out / stale).unlink(missing_ok=True)
  write_tokenizer(spec, config.vocab_size, config.max_position_embeddings, out)
  write_weights(config, out, seed=seed, dtype=dtype, max_shard_bytes=max_shard_bytes)
  fields = hf_config.config_to_hf(config, dtype=dtype)
  (out / "config.json").write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
  return config


def _parse_set(items: Sequence[str]) -> dict[str, Any]:
  overrides = {}
  for item in items:
    field, sep, value = item.partition("=")
    if not sep:
      raise SystemExit(f"--set wants FIELD=VALUE, got {item!r}")
    try:
      overrides[field] = json.loads(value)
    except json.JSONDecodeError:
      raise SystemExit(f"--set {field}: {value!r} is not a JSON value (e.g. 2, true)")
  return overrides


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m pipe_rlhf_jax.models.random_checkpoint",
      description="Write a random-weight Hugging Face model directory (config.json, "
                  "safetensors weights, a byte-level tokenizer of the model's vocabulary "
                  "size) of a published model shape, without downloading anything. It "
                  "loads with pipe_rlhf_jax.models.from_pretrained / load_tokenizer and "
                  "with transformers' AutoModelForCausalLM / AutoTokenizer.",
      epilog="example:\n  python -m pipe_rlhf_jax.models.random_checkpoint --shape "
             "qwen3-0.6b --out /tmp/qwen3-0.6b-random --dtype bfloat16\n"
             "  (a 2-layer variant: add --set num_hidden_layers=2)\n\nshapes: "
             + ", ".join(f"{n} ({s.source})" for n, s in shapes.SHAPES.items()),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shape", required=True, choices=sorted(shapes.SHAPES),
                      metavar="NAME", help="published shape (listed below)")
  parser.add_argument("--out", required=True, help="output directory (must be empty)")
  parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                      help="storage dtype of the weights (default bfloat16)")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="override a config.json size field, e.g. num_hidden_layers=2 "
                           "(repeatable)")
  parser.add_argument("--max-shard-gb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 1024**3,
                      help="split the weights into shards of at most this many GiB "
                           "(default 4)")
  parser.add_argument("--overwrite", action="store_true",
                      help="write into a directory that already holds files")
  args = parser.parse_args(argv)
  config = write_random_checkpoint(
      args.shape, args.out, seed=args.seed, dtype=args.dtype,
      overrides=_parse_set(args.set), max_shard_bytes=int(args.max_shard_gb * 1024**3),
      overwrite=args.overwrite)
  files = sorted(p.name for p in Path(args.out).iterdir())
  size = sum((Path(args.out) / f).stat().st_size for f in files)
  print(f"{args.shape}: {config.num_params():,} parameters ({config.architecture}, "
        f"{config.num_layers} layers, vocab {config.vocab_size}) in {args.dtype}, "
        f"{size / 1024**2:,.1f} MiB: {args.out}")
  print("  " + ", ".join(files))
  return 0


if __name__ == "__main__":
  sys.exit(main())
