"""Which checkpoint format a model path names: a Hugging Face directory or a GGUF file.

One rule for every reader of a model path (the model loader, the tokenizer loader and the
config check), so that they never disagree about what a path holds: a path is GGUF when
it is a `.gguf` file, or a directory holding a `.gguf` file and not the Hugging Face file
the reader wants (`config.json` for the model, `tokenizer.json` for the tokenizer).
"""

from __future__ import annotations

import os


def is_gguf(path: str | os.PathLike, hf_file: str = "config.json") -> bool:
  """Whether `path` is read as GGUF by a reader whose Hugging Face file is `hf_file`."""
  path = os.fspath(path)
  if path.endswith(".gguf"):
    return True
  return (os.path.isdir(path) and not os.path.isfile(os.path.join(path, hf_file))
          and any(name.endswith(".gguf") for name in os.listdir(path)))


def is_model_path(path: str | os.PathLike) -> bool:
  """Whether `path` holds a model `models.from_pretrained` can read: a GGUF file (or a
  directory of one), or a directory with config.json."""
  return (os.path.isfile(os.path.join(os.fspath(path), "config.json"))
          or (is_gguf(path) and (os.path.isdir(path) or os.path.isfile(path))))
