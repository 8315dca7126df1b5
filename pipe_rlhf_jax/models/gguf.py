"""GGUF checkpoints (llama.cpp, Ollama): the model, its config and its tokenizer from one file.

This module owns the translation from a GGUF file to what `models/hf.py` and
`models/tokenizer.py` already load:

* the file is read by `gguf.GGUFReader`, the reader the llama.cpp project maintains (never
  a parser of our own), and every tensor is dequantised by `gguf.quants.dequantize`;
* the architecture metadata (`general.architecture`: llama, qwen2, qwen3, gemma3; Mistral
  files say llama) becomes a Hugging Face `config.json` dict and the GGUF tensor names
  (`token_embd.weight`, `blk.N.attn_q.weight`, ...) become Hugging Face names, so the model
  is built by `hf.from_hf_tensors`: the same config policy and tensor checks as a
  `config.json` directory;
* the tokenizer metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`) becomes a
  `tokenizers.Tokenizer` and a `tokenizer_config.json`, as transformers' GGUF tokenizer
  builds them, so `load_tokenizer` returns the usual `HFTokenizer`.

What llama.cpp's converter changed is undone here, as transformers' GGUF loader does:
q/k rows of `llama` files are permuted for llama.cpp's RoPE layout (undone; qwen2, qwen3 and
gemma3 are not permuted), and gemma3 files store RMSNorm weights with Gemma's `1 +` folded
in (subtracted again).

Refused with a ValueError naming the file (and the tensor or the field): tensor types other
than `SUPPORTED_TYPES`, architectures other than the four, metadata that changes the
mathematics without a counterpart here (an unknown `<arch>.*` key, partial RoPE, RoPE
frequency-factor tensors, mixture-of-experts counts), missing or unexpected tensors, and
files the reader cannot parse (truncated, not GGUF).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
import tempfile
from typing import Any, Mapping
import warnings
import weakref

import numpy as np

from pipe_rlhf_jax.models import hf
from pipe_rlhf_jax.models.config import DTYPES, dtype_name
from pipe_rlhf_jax.models.hf_config import SUPPORTED_ARCHITECTURES as HF_CLASSES
from pipe_rlhf_jax.models.hf_config import config_from_hf

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_TYPES", "from_gguf", "gguf_tensor_name",
           "hf_config_from_gguf", "load_gguf_tokenizer", "read_gguf", "resolve_gguf",
           "tokenizer_from_gguf", "write_tokenizer_files"]

# general.architecture -> the Hugging Face class its tensors load as.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}

# Tensor types dequantised here (names of `gguf.GGMLQuantizationType`); each one is tested
# against transformers' GGUF loader.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K",
                   "Q5_K", "Q6_K")

# `<arch>.<key>` -> config.json field, copied as they are.
_MAPPED_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
# Keys checked against the mapped ones (head size, rotary width) rather than copied.
_CHECKED_KEYS = frozenset({"attention.key_length", "attention.value_length",
                           "rope.dimension_count"})
# RoPE scaling keys: passed on as `rope_scaling`, where the config policy accepts or refuses
# the type (`finetuned` is bookkeeping).
_ROPE_SCALING_KEYS = frozenset({"rope.scaling.type", "rope.scaling.factor",
                                "rope.scaling.original_context_length",
                                "rope.scaling.finetuned"})
# Per-architecture keys with a config.json counterpart of their own.
_ARCH_KEYS = {
    "gemma3": {"attention.sliding_window": "sliding_window",
               "final_logit_softcapping": "final_logit_softcapping",
               "attn_logit_softcapping": "attn_logit_softcapping"},
}

# GGUF tensor name -> Hugging Face name; per layer `blk.N.<key>` -> `model.layers.N.<value>`.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Per layer: `blk.N.<gguf>` <-> `model.layers.N.<hf>`, from the one table of per-layer
# tensors (`hf.LAYER_TENSORS`); Gemma 3 normalises around both sublayers.
_LAYER_TENSORS_BY_ARCH = {arch: hf.gguf_layer_names(gemma=arch == "gemma3")
                          for arch in ("llama", "qwen2", "qwen3", "gemma3")}
_LAYER_TENSORS = _LAYER_TENSORS_BY_ARCH["llama"]


def gguf_tensor_name(hf_name: str, architecture: str) -> str | None:
  """The GGUF name of a Hugging Face tensor name (None when GGUF has none)."""
  for gguf_name, name in _GLOBAL_TENSORS.items():
    if name == hf_name:
      return gguf_name
  parts = hf_name.split(".", 3)
  if len(parts) == 4 and parts[:2] == ["model", "layers"]:
    for key, suffix in _LAYER_TENSORS_BY_ARCH.get(architecture, _LAYER_TENSORS).items():
      if suffix == parts[3]:
        return f"blk.{parts[2]}.{key}"
  return None


def _hf_tensor_name(gguf_name: str, architecture: str) -> str | None:
  if gguf_name in _GLOBAL_TENSORS:
    return _GLOBAL_TENSORS[gguf_name]
  parts = gguf_name.split(".", 2)
  if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
    suffix = _LAYER_TENSORS_BY_ARCH.get(architecture, _LAYER_TENSORS).get(parts[2])
    if suffix is not None:
      return f"model.layers.{parts[1]}.{suffix}"
  return None


# --------------------------------------------------------------------------- reading


def resolve_gguf(path: str | os.PathLike) -> Path:
  """The GGUF file a path names: the file itself, or the one `.gguf` in a directory.

  Raises:
    FileNotFoundError: nothing at `path`, or a directory without a `.gguf`.
    ValueError: a directory with several `.gguf` files (naming them).
  """
  p = Path(path)
  if p.is_dir():
    found = sorted(p.glob("*.gguf"))
    if not found:
      raise FileNotFoundError(f"{p} holds no .gguf file (and no config.json).")
    if len(found) > 1:
      raise ValueError(f"{p} holds several GGUF files {[f.name for f in found]}; pass the "
                       f"path of the one to load.")
    return found[0]
  if not p.is_file():
    raise FileNotFoundError(f"{p} does not exist.")
  return p


class GGUFCheckpoint:
  """An open GGUF file: its reader, its metadata as Python values, its tensor names.

  Attributes:
    path: the file.
    reader: the `gguf.GGUFReader` (memory-maps the file; tensors are read on demand).
    metadata: key -> value (strings decoded, arrays as lists).
    architecture: `general.architecture`.
  """

  def __init__(self, path: Path):
    import gguf  # imported here: only GGUF files need the package

    self.path = path
    try:
      self.reader = gguf.GGUFReader(path)
      self.metadata = {key: field.contents() for key, field in self.reader.fields.items()}
    except Exception as e:  # the reader's numpy errors on short or foreign files
      raise ValueError(f"{path} is not a readable GGUF file (truncated or damaged?): "
                       f"{type(e).__name__}: {e}") from e
    self.tensors = {t.name: t for t in self.reader.tensors}
    self.architecture = self.metadata.get("general.architecture")


# Open checkpoints by (file, size, mtime): every `read_gguf` of an unchanged file returns
# the one already open, where the reader would parse the metadata again (SmolLM2's
# 49,152-token vocabulary and merges take about 4 s, Gemma 3's 262,144 tokens about 17 s;
# a job reads one file for its config, tokenizer, policy and reference). Held weakly, and
# the most recently opened one strongly as well, so that a job's successive reads (each
# dropping its checkpoint before the next) share one parse; an older file is released
# once nothing else holds it. The reader memory-maps the file: what it keeps is the
# file's pages (reclaimable) and the parsed metadata.
_OPEN: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_LAST: list[GGUFCheckpoint] = []


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
  """Opens the GGUF file `path` names (see `resolve_gguf`); raises naming the file.

  A checkpoint of the same unchanged file that is still held, or was the last one
  opened, is returned again instead of parsed a second time.
  """
  p = resolve_gguf(path)
  stat = p.stat()
  key = (str(p.resolve()), stat.st_size, stat.st_mtime_ns)
  ckpt = _OPEN.get(key)
  if ckpt is None:
    ckpt = GGUFCheckpoint(p)
    _OPEN[key] = ckpt
  _LAST[:] = [ckpt]
  return ckpt


def _check_architecture(ckpt: GGUFCheckpoint) -> str:
  arch = ckpt.architecture
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"{ckpt.path}: general.architecture={arch!r} is not supported; "
                     f"supported: {sorted(SUPPORTED_ARCHITECTURES)}.")
  if arch == "gemma3" and SUPPORTED_ARCHITECTURES[arch] not in HF_CLASSES:
    raise ValueError(f"{ckpt.path}: general.architecture='gemma3' needs Gemma 3 support in "
                     f"models/hf_config.py, which this installation lacks.")
  return arch


def hf_config_from_gguf(ckpt: GGUFCheckpoint) -> dict[str, Any]:
  """The Hugging Face `config.json` dict a GGUF file's metadata describes.

  Raises:
    ValueError: naming the file and the key, for an unsupported architecture or a key
      that changes the mathematics without a counterpart here.
  """
  arch = _check_architecture(ckpt)
  meta, path = ckpt.metadata, ckpt.path
  prefix = arch + "."
  out: dict[str, Any] = {"architectures": [SUPPORTED_ARCHITECTURES[arch]],
                         "model_type": _MODEL_TYPES[arch]}
  own = {key[len(prefix):]: value for key, value in meta.items() if key.startswith(prefix)}
  rope: dict[str, Any] = {}
  extra = _ARCH_KEYS.get(arch, {})
  for key, value in own.items():
    if key in _MAPPED_KEYS:
      if isinstance(value, list):  # a per-layer list: one value for all layers is all we have
        if len(set(value)) != 1:
          raise ValueError(f"{path}: {prefix}{key}={value} differs per layer; only one "
                           f"value for all layers is supported.")
        value = value[0]
      out[_MAPPED_KEYS[key]] = value
    elif key in extra:
      out[extra[key]] = value
    elif key in _ROPE_SCALING_KEYS:
      rope[key.rsplit(".", 1)[1]] = value
    elif key not in _CHECKED_KEYS:
      raise ValueError(f"{path}: GGUF field {prefix}{key}={value!r} is not supported (it is "
                       f"not known to leave the model's mathematics unchanged).")
  for key in ("block_count", "embedding_length", "attention.head_count"):
    if key not in own:
      raise ValueError(f"{path}: the GGUF metadata lacks {prefix}{key}.")
  hidden, heads = int(own["embedding_length"]), int(own["attention.head_count"])
  key_length = own.get("attention.key_length")
  value_length = own.get("attention.value_length", key_length)
  if key_length != value_length:
    raise ValueError(f"{path}: {prefix}attention.key_length={key_length} != "
                     f"attention.value_length={value_length}; one head size is supported.")
  rotary = own.get("rope.dimension_count")
  head_dim = key_length or (rotary if arch == "llama" else None) or hidden // heads
  if rotary is not None and rotary != head_dim:
    raise ValueError(f"{path}: {prefix}rope.dimension_count={rotary} rotates part of a head "
                     f"of {head_dim} (partial RoPE), which is not supported.")
  out["head_dim"] = int(head_dim)
  if rope and rope.get("type", "none") != "none":
    scaling = {"rope_type": rope["type"]}
    if "factor" in rope:
      scaling["factor"] = rope["factor"]
    if "original_context_length" in rope:
      scaling["original_max_position_embeddings"] = rope["original_context_length"]
    out["rope_scaling"] = scaling
  if "rope_freqs.weight" in ckpt.tensors:
    raise ValueError(f"{path}: tensor rope_freqs.weight holds per-frequency RoPE factors "
                     f"(llama3-style scaling), which GGUF import does not support.")
  if "vocab_size" not in out:
    tokens = meta.get("tokenizer.ggml.tokens")
    embedding = ckpt.tensors.get("token_embd.weight")
    if tokens is not None:
      out["vocab_size"] = len(tokens)
    elif embedding is not None:
      out["vocab_size"] = int(embedding.shape[-1])
  out["tie_word_embeddings"] = "output.weight" not in ckpt.tensors
  if arch in ("llama", "qwen3"):
    out["attention_bias"] = "blk.0.attn_q.bias" in ckpt.tensors
  if "blk.0.ffn_up.bias" in ckpt.tensors:
    out["mlp_bias"] = True  # refused by the config policy, naming mlp_bias
  for field, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                     ("pad_token_id", "padding_token_id")):
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is not None:
      out[field] = int(value)
  out["torch_dtype"] = "float32"
  return out


def _check_tensors(ckpt: GGUFCheckpoint, hf_config: Mapping[str, Any]) -> dict[str, str]:
  """GGUF name -> HF name for every tensor, after checking names, shapes and types."""
  arch, path = ckpt.architecture, ckpt.path
  names: dict[str, str] = {}
  problems = []
  for name, tensor in ckpt.tensors.items():
    kind = tensor.tensor_type
    if kind.name not in SUPPORTED_TYPES:
      raise ValueError(f"{path}: tensor {name!r} has type {kind.name}, which is not "
                       f"supported; supported types: {list(SUPPORTED_TYPES)}.")
    hf_name = _hf_tensor_name(name, arch)
    if hf_name is None:
      problems.append(f"unexpected tensor {name!r} (shape {_shape(tensor)}) is not used by "
                      f"a {arch} model")
    else:
      names[name] = hf_name
  expected = hf.hf_tensor_shapes(config_from_hf(hf_config))
  by_hf = {v: k for k, v in names.items()}
  for hf_name, shape in expected.items():
    name = by_hf.get(hf_name) or gguf_tensor_name(hf_name, arch) or hf_name
    if hf_name not in by_hf:
      problems.append(f"missing tensor {name!r} ({hf_name}, shape {shape})")
    elif _shape(ckpt.tensors[name]) != shape:
      problems.append(f"tensor {name!r} ({hf_name}): expected shape {shape}, got "
                      f"{_shape(ckpt.tensors[name])}")
  for name, hf_name in names.items():
    if hf_name not in expected:
      problems.append(f"unexpected tensor {name!r} ({hf_name}) is not used by this config")
  if problems:
    raise ValueError(f"{path} does not match its metadata:\n  " + "\n  ".join(problems))
  return names


def _shape(tensor) -> tuple[int, ...]:
  """A GGUF tensor's shape in numpy (row-major) order: GGUF lists the fastest dim first."""
  return tuple(int(n) for n in reversed(tensor.shape))


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's q/k row order (`LlamaModel.permute` in convert_hf_to_gguf.py).

  llama.cpp regroups each head's rows [half 0 | half 1] as interleaved pairs for its
  RoPE kernel; the inverse swaps the axes back. Works on weights [heads*d, in] and biases.
  """
  rows = w.shape[0]
  return (w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


def _load_tensors(ckpt: GGUFCheckpoint, names: Mapping[str, str],
                  hf_config: Mapping[str, Any], dtype: Any) -> dict[str, np.ndarray]:
  """HF name -> dequantised tensor in `dtype`, llama.cpp's conversions undone."""
  from gguf.quants import dequantize

  arch, path = ckpt.architecture, ckpt.path
  np_dtype = np.dtype(DTYPES[dtype_name(dtype)])
  heads = int(hf_config["num_attention_heads"])
  kv_heads = int(hf_config.get("num_key_value_heads") or heads)
  out = {}
  for name, hf_name in names.items():
    tensor = ckpt.tensors[name]
    try:
      w = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32)
      w = w.reshape(_shape(tensor))
    except Exception as e:
      raise ValueError(f"{path}: tensor {name!r} ({tensor.tensor_type.name}) could not be "
                       f"dequantised: {type(e).__name__}: {e}") from e
    if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
      w = _unpermute(w, heads if ".attn_q." in name else kv_heads)
    if arch == "gemma3" and name.endswith("norm.weight"):
      w = w - 1.0  # llama.cpp stores Gemma's (1 + w) scale; transformers' weight is w
    out[hf_name] = w.astype(np_dtype, copy=False)
  return out


@contextlib.contextmanager
def _naming(path: Path):
  """Prefixes the file to a config-policy ValueError raised inside the block."""
  try:
    yield
  except ValueError as e:
    if str(path) in str(e):
      raise
    raise ValueError(f"{path}: {e}") from e


def from_gguf(path: str | os.PathLike, *, dtype: Any = "float32", param_dtype: Any = None,
              head: str | None = None, seed: int = 0):
  """Loads a GGUF checkpoint as a `Transformer` (`models.from_pretrained` calls this).

  Args:
    path: a `.gguf` file, or a directory holding exactly one.
    dtype / param_dtype / head / seed: as in `hf.from_pretrained`; tensors are
      dequantised to float32 and stored in `param_dtype` (default `dtype`).

  Returns:
    The model.
  """
  ckpt = read_gguf(path)
  with _naming(ckpt.path):
    hf_config = hf_config_from_gguf(ckpt)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # the same config is parsed (and warns) again below
      names = _check_tensors(ckpt, hf_config)
    storage = param_dtype if param_dtype is not None else dtype
    return hf.from_hf_tensors(
        hf_config, lambda: _load_tensors(ckpt, names, hf_config, storage), dtype=dtype,
        param_dtype=param_dtype, head=head, seed=seed, source=ckpt.path)


# --------------------------------------------------------------------------- tokenizer

# llama.cpp token types (`gguf.TokenType`).
_CONTROL, _USER_DEFINED = 3, 4

# `tokenizer.ggml.pre` -> the split regex its merges were learned with (transformers'
# GGUF table; a name not listed keeps byte-level BPE's GPT-2 split, as there).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}
# Sentencepiece vocabularies of these architectures are Gemma's (its own spelling of runs
# of spaces, merges in file order).
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
  bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1)))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def _generate_merges(vocab: Mapping[str, int], scores: Mapping[str, float]
                     ) -> list[tuple[str, str]]:
  """BPE merges a sentencepiece vocabulary implies, best score first (as transformers)."""
  merges = []
  for piece, score in scores.items():
    local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
             if piece[:i] in vocab and piece[i:] in vocab]
    local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.extend(local)
  merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
  return [(a, b) for a, b, _ in merges]


def tokenizer_from_gguf(ckpt: GGUFCheckpoint):
  """The `tokenizers.Tokenizer` and the tokenizer_config.json dict a GGUF file describes.

  Byte-level BPE (`tokenizer.ggml.model` "gpt2": SmolLM2, LLaMA 3, Qwen) and sentencepiece
  BPE ("llama": LLaMA 2, Mistral; Gemma's variant for gemma* architectures) are built as
  transformers' GGUF tokenizer builds them: control tokens become special added tokens,
  user-defined ones plain added tokens, BOS / EOS are inserted by the post-processor as
  `tokenizer.ggml.add_bos_token` / `add_eos_token` say.

  Raises:
    ValueError: naming the file, for another tokenizer model or a file without one.
  """
  from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
  )

  meta, path = ckpt.metadata, ckpt.path
  kind = meta.get("tokenizer.ggml.model")
  tokens = meta.get("tokenizer.ggml.tokens")
  if tokens is None or kind is None:
    raise ValueError(f"{path} has no tokenizer (tokenizer.ggml.model / tokens missing).")
  tokens = list(tokens)
  types = list(meta.get("tokenizer.ggml.token_type") or [])
  file_merges = meta.get("tokenizer.ggml.merges")
  add_bos = meta.get("tokenizer.ggml.add_bos_token")
  if kind == "gpt2":
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in file_merges or []]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None,
                               continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre")
    split = _PRE_SPLITS.get(pre)
    if split is None:
      tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
      tok.pre_tokenizer = pre_tokenizers.Sequence([
          pre_tokenizers.Split(Regex(split), behavior="isolated"),
          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    control_ok = alphabet
  elif kind == "llama":
    gemma = ckpt.architecture in _GEMMA_ARCHITECTURES
    if add_bos is None:
      add_bos = True  # llama.cpp adds BOS to a sentencepiece vocabulary that is silent
    if gemma:  # Gemma stores a token of spaces as spaces; its BPE spells them with U+2581
      tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if file_merges:
      merges = [tuple(m.split(" ")) for m in file_merges]
    elif gemma:  # Gemma's scores do not follow its merge order; the file order does
      merges = _generate_merges(vocab, {t: -i for i, t in enumerate(tokens)})
    else:
      merges = _generate_merges(vocab, dict(zip(tokens, meta["tokenizer.ggml.scores"])))
    if gemma:
      tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>",
                                 dropout=None, byte_fallback=True))
      tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
      tok.normalizer = normalizers.Replace(" ", "\u2581")
      tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "),
                                       decoders.ByteFallback(), decoders.Fuse()])
    else:
      tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True,
                                 byte_fallback=True, dropout=None))
      tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                   prepend_scheme="first", split=False)
      tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "),
                                       decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(content=" ", left=1)])
    control_ok = None
  else:
    raise ValueError(f"{path}: tokenizer.ggml.model={kind!r} is not supported; supported: "
                     f"['gpt2', 'llama'].")

  specials: dict[str, str | None] = {}
  for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                    ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
    index = meta.get(f"tokenizer.ggml.{key}")
    specials[name] = tokens[int(index)] if index is not None else None
  control = [t for t, k in zip(tokens, types)
             if k == _CONTROL and (control_ok is None or set(t) <= control_ok)]
  named = [t for t in specials.values() if t is not None and t not in control]
  tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                          for t in control + named])
  vocab_now = tok.get_vocab()
  user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
          if k == _USER_DEFINED and t in vocab_now]
  if user:
    tok.add_tokens(user)

  add_bos = bool(add_bos) and specials["bos_token"] is not None
  add_eos = bool(meta.get("tokenizer.ggml.add_eos_token")) and specials["eos_token"] is not None
  bos, eos = specials["bos_token"], specials["eos_token"]
  single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
  pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
  special_ids = [(t, tok.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
  tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                     special_tokens=special_ids)

  config: dict[str, Any] = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      **specials,
      "add_bos_token": add_bos,
      "add_eos_token": add_eos,
      "clean_up_tokenization_spaces": False,
  }
  context = meta.get(f"{ckpt.architecture}.context_length")
  if context is not None:
    config["model_max_length"] = int(context)
  template = meta.get("tokenizer.chat_template")
  if template:
    config["chat_template"] = template
  return tok, config


def write_tokenizer_files(path: str | os.PathLike | GGUFCheckpoint,
                          out_dir: str | os.PathLike) -> Path:
  """Writes tokenizer.json and tokenizer_config.json (chat template, specials) to out_dir.

  Args:
    path: the GGUF file (or directory holding one), or an open `GGUFCheckpoint`.
    out_dir: the directory (created if missing).

  Returns:
    `out_dir`.
  """
  ckpt = path if isinstance(path, GGUFCheckpoint) else read_gguf(path)
  tok, config = tokenizer_from_gguf(ckpt)
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  tok.save(str(out / "tokenizer.json"))
  (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
  return out


def load_gguf_tokenizer(path: str | os.PathLike):
  """The `HFTokenizer` of a GGUF file (`models.load_tokenizer` calls this).

  The files `write_tokenizer_files` writes go through `HFTokenizer` itself, so the ids,
  the specials and the chat template behave as from a Hugging Face directory; the
  tokenizer then names the GGUF file as its origin.
  """
  from pipe_rlhf_jax.models.tokenizer import HFTokenizer

  ckpt = read_gguf(path)
  with tempfile.TemporaryDirectory() as tmp:
    write_tokenizer_files(ckpt, tmp)
    tok = HFTokenizer(tmp)
  tok.path = tok.directory = str(ckpt.path)
  if tok._chat_found is not None:  # template errors name the GGUF file, not a deleted copy
    tok._chat_found = (tok._chat_found[0], str(ckpt.path))
  return tok
