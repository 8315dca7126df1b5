"""The package's layers (stated in `pipe_rlhf_jax/__init__.py`): read from the imports.

Every `import` of a `pipe_rlhf_jax` module, at module level or inside a function (a lazy
import is still a dependency), is checked against the layer table: a module may import its
own layer or lower ones, never a higher one, and the module graph has no cycle. Imports
under `if TYPE_CHECKING:` are annotations only and are left out.
"""

import ast
import os

import pytest

import pipe_rlhf_jax

ROOT = os.path.dirname(pipe_rlhf_jax.__file__)
PACKAGE = "pipe_rlhf_jax"


def module_layers() -> dict[str, int]:
  return {name: index for index, (_, names) in enumerate(pipe_rlhf_jax.LAYERS)
          for name in names}


def top_unit(module: str) -> str:
  """`pipe_rlhf_jax.stages.train` -> `stages`; `pipe_rlhf_jax.train` -> `train`."""
  return module.split(".")[1]


def package_modules() -> dict[str, str]:
  """Dotted module name -> file path, for every module of the package."""
  out = {}
  for dirpath, _, files in os.walk(ROOT):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(ROOT))
        name = rel[:-3].replace(os.sep, ".")
        out[name.removesuffix(".__init__")] = os.path.join(dirpath, f)
  return out


def _type_checking_nodes(tree) -> set[int]:
  skip = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      for child in node.body:
        skip.update(id(n) for n in ast.walk(child))
  return skip


def imports_of(name: str, path: str, modules) -> list[tuple[str, int]]:
  """(imported package module, line) for each import of the package in one file."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  skip = _type_checking_nodes(tree)
  is_package = path.endswith("__init__.py")
  out = []
  for node in ast.walk(tree):
    if id(node) in skip:
      continue
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
      else:
        module = node.module or ""
      targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module
                 for a in node.names]
    else:
      continue
    out += [(t, node.lineno) for t in targets if t.startswith(PACKAGE + ".")]
  return out


def test_every_package_unit_has_a_layer():
  units = {top_unit(m) for m in package_modules() if m != PACKAGE}
  missing = units - set(module_layers())
  assert not missing, f"add these to pipe_rlhf_jax.LAYERS: {sorted(missing)}"


def test_no_import_reaches_a_higher_layer():
  layers = module_layers()
  modules = package_modules()
  upward = []
  for name, path in modules.items():
    if name == PACKAGE:
      continue
    own = layers[top_unit(name)]
    for target, line in imports_of(name, path, modules):
      if target == PACKAGE:
        continue
      theirs = layers[top_unit(target)]
      if theirs > own:
        upward.append(f"{os.path.relpath(path, os.path.dirname(ROOT))}:{line} imports "
                      f"{target} (layer {theirs} > {own})")
  assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_module_graph_has_no_cycle():
  modules = package_modules()
  graph = {name: set() for name in modules}
  for name, path in modules.items():
    for target, _ in imports_of(name, path, modules):
      # A package's `__init__` re-exporting its modules is the package itself, not a cycle.
      if target in modules and target != name and not name.startswith(target + ".") and (
          not target.startswith(name + ".")):
        graph[name].add(target)
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        cycle = stack[stack.index(nxt):] + [nxt]
        pytest.fail("import cycle: " + " -> ".join(cycle))
      if nxt not in state:
        visit(nxt)
    stack.pop()
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node)
