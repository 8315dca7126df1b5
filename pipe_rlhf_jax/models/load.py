"""Loading a model, or its config, from a checkpoint of either format.

Owns the entry points users and the job call, `from_pretrained(path)`,
`load_tokenizer(spec)` and `read_hf_config(path)`: each reads the path's format
(`checkpoint_files.is_gguf`) and hands it to the reader of that format, `models/hf.py`
(or `models/tokenizer.py`) for a Hugging Face directory and `models/gguf.py` for a GGUF
file. Both readers end in the same builder
(`hf.from_hf_tensors`), so a checkpoint means the same model in either format. The
format modules never import each other's entry point: GGUF reuses the Hugging Face
mapping, not the other way round.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pipe_rlhf_jax.models import hf
from pipe_rlhf_jax.models import tokenizer as tokenizer_lib
from pipe_rlhf_jax.models.checkpoint_files import is_gguf
from pipe_rlhf_jax.models.transformer import Transformer


def from_pretrained(path: str | os.PathLike, *, dtype: Any = "float32",
                    param_dtype: Any = None, head: str | None = None,
                    seed: int = 0) -> Transformer:
  """Loads a LLaMA / Qwen2 / Qwen3 / Mistral / Gemma 3 checkpoint from `path`.

  Args:
    path: a Hugging Face directory (config.json and safetensors), or a `.gguf` file, or a
      directory holding one `.gguf` and no config.json.
    dtype, param_dtype, head, seed: as in `hf.from_pretrained`.

  Returns:
    The model with every parameter set from the checkpoint.
  """
  if is_gguf(path):
    from pipe_rlhf_jax.models import gguf  # the gguf package is needed for GGUF files only
    return gguf.from_gguf(path, dtype=dtype, param_dtype=param_dtype, head=head, seed=seed)
  return hf.from_pretrained(path, dtype=dtype, param_dtype=param_dtype, head=head, seed=seed)


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
  """The Hugging Face config a checkpoint path describes: its config.json, or the config
  a GGUF file's metadata maps to (`gguf.hf_config_from_gguf`; no tensor is read)."""
  if is_gguf(path):
    from pipe_rlhf_jax.models import gguf
    return gguf.hf_config_from_gguf(gguf.read_gguf(path))
  with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
    return json.load(f)


def load_tokenizer(spec: str | os.PathLike) -> tokenizer_lib.Tokenizer:
  """The tokenizer `spec` names: "byte", a Hugging Face directory or tokenizer.json
  (`tokenizer.load_tokenizer`), or a `.gguf` file / a directory holding one and no
  tokenizer.json (the tokenizer its metadata describes, `gguf.load_gguf_tokenizer`)."""
  if isinstance(spec, (str, os.PathLike)) and os.fspath(spec) not in ("", "byte") and is_gguf(
      spec, hf_file="tokenizer.json"):
    from pipe_rlhf_jax.models import gguf  # the gguf package is needed for GGUF files only
    return gguf.load_gguf_tokenizer(spec)
  return tokenizer_lib.load_tokenizer(spec)
