"""GGUF -> Hugging Face directory: `python -m pipe_rlhf_jax.models.convert --gguf F --out D`.

Owns the command line only: the model is loaded by `models/gguf.py` (dequantised, the
config and tensor policy applied) and written by `hf.save_pretrained` (config.json and
model.safetensors); the tokenizer files (tokenizer.json, tokenizer_config.json with the
chat template and the special tokens) come from `gguf.write_tokenizer_files`. The result
loads here and in transformers (`AutoModelForCausalLM` / `AutoTokenizer.from_pretrained`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
import shutil
import sys
import tempfile

from pipe_rlhf_jax.models import gguf, hf


def convert(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *,
            dtype: str = "float32") -> Path:
  """Writes a Hugging Face directory holding the GGUF file's model and tokenizer.

  Args:
    gguf_path: a `.gguf` file (or a directory holding exactly one).
    out_dir: the directory to write; must be absent or empty. It appears only once
      complete (the files are written beside it first, then moved in).
    dtype: dtype of the written tensors ("float32" or "bfloat16").

  Returns:
    `out_dir`.

  Raises:
    FileNotFoundError: no GGUF file at `gguf_path`.
    FileExistsError: `out_dir` exists and is not an empty directory.
    ValueError: a damaged or unsupported file (naming it, and the tensor or field).
  """
  out = Path(out_dir)
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise FileExistsError(f"{out} exists and is not an empty directory; choose another "
                          f"--out or remove it.")
  ckpt = gguf.read_gguf(gguf_path)
  model = gguf.from_gguf(ckpt.path, dtype=dtype)
  out.parent.mkdir(parents=True, exist_ok=True)
  staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
  staging.chmod(0o755)  # mkdtemp's private mode would otherwise become the output's
  try:
    hf.save_pretrained(model, staging, dtype=dtype)
    gguf.write_tokenizer_files(ckpt, staging)
    if out.exists():
      out.rmdir()
    staging.rename(out)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  return out


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m pipe_rlhf_jax.models.convert",
      description="Convert a GGUF checkpoint (llama, qwen2, qwen3, gemma3) into a Hugging "
                  "Face directory (config.json, model.safetensors, tokenizer files).")
  parser.add_argument("--gguf", required=True, help="the .gguf file")
  parser.add_argument("--out", required=True, help="output directory (absent or empty)")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                      help="dtype of the written tensors (default float32)")
  args = parser.parse_args(argv)
  try:
    out = convert(args.gguf, args.out, dtype=args.dtype)
  except (FileNotFoundError, FileExistsError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
