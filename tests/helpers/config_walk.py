"""How a reader follows the settings through the package: where the walk climbs back up.

A *climb* is a function in one layer of the package (`pipe_rlhf_jax.LAYERS`) that takes a
settings object whose class is defined in a higher layer: its annotation or its
docstring's arguments name the class, which the module cannot import, so it reads the
object by duck typing and a reader must climb up the layers to learn its fields (a
typed setting at the bottom of the house makes every such read a plain, imported type).
A *whole-experiment read* is a function below the job that takes the experiment's
settings (`ExperimentSettings` or `Experiment`) and reads one field of it.

Run on the working tree, or on any commit of the repository's history:

  python -m tests.helpers.config_walk            # the working tree
  python -m tests.helpers.config_walk a11f7dd    # a commit
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The settings classes by their names' endings (a model's TransformerConfig is the model's
# shape, not a setting of the run).
SETTINGS_CLASS = re.compile(r"(Settings|Config|Hyper|Params|Spec|Plan|PlannedRun|PlanChoice|"
                            r"PolicySamplingSettings)$")
WHOLE = ("ExperimentSettings", "Experiment")


def _git(*args: str) -> str:
  return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT,
                        check=True).stdout


def sources(rev: str | None = None) -> dict[str, str]:
  """{path: source} of the package's modules in the working tree, or at commit `rev`."""
  if rev is None:
    paths = _git("ls-files", "pipe_rlhf_jax").split()
    return {p: open(os.path.join(ROOT, p), encoding="utf-8").read()
            for p in paths if p.endswith(".py") and os.path.exists(os.path.join(ROOT, p))}
  paths = _git("ls-tree", "-r", "--name-only", rev, "pipe_rlhf_jax").split()
  return {p: _git("show", f"{rev}:{p}") for p in paths if p.endswith(".py")}


def _unit(path: str) -> str:
  return path.split("/")[1].removesuffix(".py")


def layers_of(srcs: dict[str, str]) -> dict[str, int]:
  """Top-level unit -> layer index, read from that tree's `LAYERS`."""
  tree = ast.parse(srcs["pipe_rlhf_jax/__init__.py"])
  for node in tree.body:
    if isinstance(node, ast.Assign) and node.targets[0].id == "LAYERS":
      table = ast.literal_eval(node.value)
      return {name: i for i, (_, names) in enumerate(table) for name in names}
  raise ValueError("pipe_rlhf_jax/__init__.py has no LAYERS")


def _functions(srcs):
  for path, src in srcs.items():
    for node in ast.walk(ast.parse(src)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        yield path, node


def climbs(rev: str | None = None) -> list[str]:
  """One line per function that takes a settings object defined in a higher layer."""
  srcs = sources(rev)
  layer = layers_of(srcs)
  defined = {}
  for path, src in srcs.items():
    for node in ast.parse(src).body:
      if isinstance(node, ast.ClassDef) and SETTINGS_CLASS.search(node.name) and (
          "Transformer" not in node.name):
        defined.setdefault(node.name, path)
  out = []
  for path, fn in _functions(srcs):
    if _unit(path) not in layer:
      continue
    args = fn.args.args + fn.args.kwonlyargs
    doc = ast.get_docstring(fn) or ""
    said = " ".join(ast.unparse(a.annotation) for a in args if a.annotation)
    said += " " + (doc.split("Args:", 1)[1] if "Args:" in doc else doc if args else "")
    for name, where in sorted(defined.items()):
      if layer[_unit(where)] > layer[_unit(path)] and re.search(rf"\b{name}\b", said):
        out.append(f"{path}:{fn.lineno} {fn.name} takes a {name} ({where})")
  return out


def whole_experiment_reads(rev: str | None = None) -> list[str]:
  """One line per function below the job that takes the experiment to read one field."""
  srcs = sources(rev)
  layer = layers_of(srcs)
  out = []
  for path, fn in _functions(srcs):
    if _unit(path) not in layer or layer[_unit(path)] >= layer["job"]:
      continue
    for a in fn.args.args + fn.args.kwonlyargs:
      if not (a.annotation and ast.unparse(a.annotation) in WHOLE):
        continue
      reads = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)
               and isinstance(n.value, ast.Name) and n.value.id == a.arg}
      passed = any(isinstance(n, ast.Call) and any(
          isinstance(x, ast.Name) and x.id == a.arg for x in n.args) for n in ast.walk(fn))
      if len(reads) <= 1 and not passed and "to_dict" not in reads:
        out.append(f"{path}:{fn.lineno} {fn.name} reads only {sorted(reads)} of {a.arg}")
  return out


def main(argv: list[str]) -> int:
  rev = argv[0] if argv else None
  found, whole = climbs(rev), whole_experiment_reads(rev)
  print("\n".join(found + whole))
  print(f"{rev or 'working tree'}: {len(found)} climbs, {len(whole)} whole-experiment reads")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
