"""Logical axis names -> mesh axes: parameter shardings and activation constraints.

The model annotates every parameter and activation dimension with a logical name
("batch", "embed", "heads", ...). A rule table maps each name to a mesh axis (or a
tuple of axes, or None). This module owns that table per stage, the translation to
PartitionSpec / NamedSharding, the divisibility check with readable errors, and the
context that lets `constrain(x, axes)` pin activation layouts inside jitted code.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
import contextlib
import contextvars
import math
from typing import Any

from jax.sharding import NamedSharding, PartitionSpec

LOGICAL_AXES: tuple[str, ...] = (
    "batch", "length", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab",
    "layers", "microbatches", "cache_batch", "cache_length")

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

# One table serves every stage because a size-1 mesh axis shards nothing: a
# generate mesh with tensor=4 shards heads/mlp/vocab, a train mesh with fsdp=8
# shards embed and the batch, and the other axes silently drop out.
#  * batch spans data and fsdp: FSDP is data parallelism whose params are gathered
#    per layer, so activations split over both.
#  * embed -> fsdp shards every weight matrix along its model dim (ZeRO-3); in
#    activations embed finds fsdp already taken by batch and stays unsharded.
#  * heads/kv_heads/mlp/vocab -> tensor is the Megatron split (column-parallel in,
#    row-parallel out), one all-reduce per block.
#  * layers -> pipeline gives each pipeline stage its contiguous slice of the stacked
#    layer axis.
#  * KV caches (the pipelined decoder's [layers, microbatches, cache_batch,
#    kv_heads, cache_length, head_dim]) follow their layers and kv heads; every stage
#    keeps all of its micro-batches, the cache's rows split like the batch, and the
#    slots stay whole because every decode step writes one of them.
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", "pipeline"),
    ("microbatches", None),
    ("cache_batch", ("data", "fsdp")),
    ("cache_length", None),
)

# Training runs the whole layer stack every step (forward + backward), so slicing
# layers over a pipeline axis would only serialise the devices; train therefore keeps
# layers whole and any pipeline devices should be folded into data/fsdp instead.
# Inference (ref/reward/critic forward passes) is a single prefill-like pass whose
# latency is dominated by weights, so it keeps the default and may use pipeline when a
# model does not fit otherwise. Generation is where `pipe` earns its keep
# (delayed inter-batch pipelining keeps every stage busy).
_TRAIN_RULES: Rules = tuple(
    (name, None if name == "layers" else axes) for name, axes in DEFAULT_RULES)

STAGE_RULES: dict[str, Rules] = {
    "generate": DEFAULT_RULES,
    "infer": DEFAULT_RULES,
    "train": _TRAIN_RULES,
}


def _normalise_axes(axes: MeshAxes) -> tuple[str, ...]:
  if axes is None:
    return ()
  if isinstance(axes, str):
    return (axes,)
  return tuple(axes)


def _check_logical_axes(logical_axes: Any, where: str) -> tuple[str | None, ...]:
  if isinstance(logical_axes, str) or not isinstance(logical_axes, Sequence):
    raise TypeError(
        f"logical axes{where} must be a tuple of names (or None) per dim, got"
        f" {logical_axes!r}; write e.g. ('embed',) rather than 'embed'")
  return tuple(logical_axes)


def logical_to_spec(logical_axes: Sequence[str | None],
                    rules: Rules,
                    mesh=None) -> PartitionSpec:
  """Translates per-dim logical names into a PartitionSpec.

  For each dim, the first rule for its name whose mesh axes are all still unused
  in this spec wins (so a mesh axis shards at most one dim). A rule naming None
  (or only size-1 axes, when `mesh` is given) leaves the dim unsharded.

  Args:
    logical_axes: one logical name (or None) per array dim.
    rules: (logical_name, mesh_axis | tuple_of_axes | None) pairs.
    mesh: optional Mesh; when given, size-1 and absent axes are dropped so the
      spec only names axes that actually split data.

  Returns:
    A PartitionSpec with one entry per dim.

  Raises:
    ValueError: a logical name that no rule mentions (add a rule for it).
  """
  logical_axes = _check_logical_axes(logical_axes, "")
  known = {name for name, _ in rules}
  used: set[str] = set()
  spec: list[MeshAxes] = []
  for name in logical_axes:
    if name is None:
      spec.append(None)
      continue
    if name not in known:
      raise ValueError(
          f"logical axis {name!r} has no rule; add ({name!r}, <mesh axis or"
          f" None>) to the rules (known names: {sorted(known)})")
    chosen: MeshAxes = None
    for rule_name, rule_axes in rules:
      if rule_name != name:
        continue
      axes = _normalise_axes(rule_axes)
      if mesh is not None:
        axes = tuple(a for a in axes if mesh.shape.get(a, 1) > 1)
      if used.intersection(axes):
        continue
      used.update(axes)
      chosen = None if not axes else axes[0] if len(axes) == 1 else axes
      break
    spec.append(chosen)
  return PartitionSpec(*spec)


def logical_sharding(mesh, logical_axes: Sequence[str | None],
                     rules: Rules) -> NamedSharding:
  """NamedSharding on `mesh` for an array annotated with `logical_axes`."""
  return NamedSharding(mesh, logical_to_spec(logical_axes, rules, mesh))


def is_logical_leaf(x: Any) -> bool:
  """True for a tuple of logical names (the leaves of a logical-axes pytree)."""
  return isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x)


def tree_shardings(mesh, logical_tree: Any, rules: Rules) -> Any:
  """Maps a pytree of logical-name tuples to a matching pytree of NamedShardings.

  Args:
    mesh: target Mesh.
    logical_tree: pytree whose leaves are tuples like ("embed", "mlp"); the
      tuples are leaves, not containers.
    rules: logical -> mesh axis rules.

  Returns:
    The same structure with a NamedSharding at every leaf.
  """
  import jax

  return jax.tree.map(lambda axes: logical_sharding(mesh, axes, rules),
                      logical_tree, is_leaf=is_logical_leaf)


def path_str(path: Sequence[Any]) -> str:
  """jax key path -> 'layers/attn/k_proj/kernel'."""
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)


def _shape_of(x: Any) -> tuple[int, ...]:
  if hasattr(x, "shape"):
    return tuple(int(d) for d in x.shape)
  return tuple(int(d) for d in x)


def _axes_text(axes: tuple[str, ...]) -> str:
  return "*".join(axes)


def check_divisible(shape_tree: Any, logical_tree: Any, mesh, rules: Rules) -> None:
  """Checks every sharded dim divides evenly by its mesh axes.

  Args:
    shape_tree: pytree with the structure of `logical_tree` whose leaves are
      arrays, ShapeDtypeStructs or shape tuples.
    logical_tree: pytree of logical-name tuples.
    mesh: the Mesh the arrays will live on.
    rules: logical -> mesh axis rules.

  Raises:
    ValueError: listing every offending parameter path, dim, mesh axis and size,
      and the sizes that would work; also for rank mismatches.
  """
  import jax

  errors: list[str] = []

  def check(path, axes, shaped):
    where = path_str(path) or "<root>"
    shape = _shape_of(shaped)
    if len(shape) != len(axes):
      errors.append(
          f"{where}: shape {shape} has {len(shape)} dims but logical axes"
          f" {axes} have {len(axes)}; give one logical name per dim")
      return
    spec = logical_to_spec(axes, rules, mesh)
    for dim, (name, dim_size, entry) in enumerate(zip(axes, shape, spec)):
      mesh_axes = _normalise_axes(entry)
      if not mesh_axes:
        continue
      mesh_size = math.prod(mesh.shape[a] for a in mesh_axes)
      if dim_size % mesh_size:
        ok = sorted(d for d in range(1, min(dim_size, mesh.size) + 1)
                    if dim_size % d == 0)
        ok_text = "{" + ",".join(str(d) for d in ok) + "}"
        axes_text = _axes_text(mesh_axes)
        errors.append(
            f"{name}={dim_size} is not divisible by {axes_text}={mesh_size} at"
            f" {where} (dim {dim} of shape {shape}); use {axes_text} in {ok_text}")

  jax.tree_util.tree_map_with_path(
      check, logical_tree, shape_tree, is_leaf=is_logical_leaf)
  if errors:
    raise ValueError("sharding does not divide evenly:\n  " + "\n  ".join(errors))


# ---------------------------------------------------------------------------
# Activation constraints.
# ---------------------------------------------------------------------------

_CONTEXT: contextvars.ContextVar[tuple[Any, Rules] | None] = contextvars.ContextVar(
    "pipe_rlhf_jax_axis_rules", default=None)


@contextlib.contextmanager
def axis_rules(mesh, rules: Rules) -> Iterator[None]:
  """Activates (mesh, rules) for `constrain` while tracing inside this block.

  Args:
    mesh: the Mesh activations live on; None deactivates constraints (handy to
      wrap code traced inside shard_map).
    rules: logical -> mesh axis rules.
  """
  token = _CONTEXT.set(None if mesh is None else (mesh, tuple(rules)))
  try:
    yield
  finally:
    _CONTEXT.reset(token)


def current_axis_rules() -> tuple[Any, Rules] | None:
  """The active (mesh, rules), or None outside `axis_rules`."""
  return _CONTEXT.get()


def _inside_manual_region() -> bool:
  """True while tracing a shard_map body (manual axes: constraints don't apply)."""
  try:
    import jax
    return bool(jax.sharding.get_abstract_mesh().manual_axes)
  except Exception:  # pylint: disable=broad-except
    # Older/newer jax without this API: rely on the caller not activating rules.
    return False


def activation_spec(shape: Sequence[int], logical_axes: Sequence[str | None],
                    mesh, rules: Rules) -> PartitionSpec:
  """Like `logical_to_spec` but drops mesh axes a dim is not divisible by.

  Activations can be legitimately small (a batch of 1 during sampling), where
  sharding the dim is impossible; replicating it is then the right answer. For a
  tuple of axes, the longest prefix whose product divides the dim is kept.
  """
  spec = logical_to_spec(logical_axes, rules, mesh)
  out: list[MeshAxes] = []
  for dim_size, entry in zip(shape, spec):
    kept: list[str] = []
    product = 1
    for axis in _normalise_axes(entry):
      if dim_size % (product * mesh.shape[axis]):
        break
      product *= mesh.shape[axis]
      kept.append(axis)
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*out)


def constrain(x, logical_axes: Sequence[str | None]):
  """Pins the sharding of activation `x` when an `axis_rules` context is active.

  A no-op outside a context and inside shard_map bodies, so model code can call
  it unconditionally.

  Args:
    x: array (usually a tracer inside jit).
    logical_axes: one logical name (or None) per dim of `x`.

  Returns:
    `x`, possibly wrapped in a sharding constraint.
  """
  context = _CONTEXT.get()
  if context is None:
    return x
  logical_axes = _check_logical_axes(logical_axes, " for constrain")
  if len(logical_axes) != x.ndim:
    raise ValueError(
        f"constrain got logical axes {logical_axes} for an array of shape"
        f" {x.shape}; give one name (or None) per dim")
  if _inside_manual_region():
    return x
  import jax

  mesh, rules = context
  spec = activation_spec(x.shape, logical_axes, mesh, rules)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def rules_from_config(config: Mapping[str, Any] | None,
                      base: Rules = DEFAULT_RULES,
                      field: str = "rules") -> Rules:
  """Overrides entries of `base` from a {logical_name: mesh_axes} mapping.

  Args:
    config: e.g. {"layers": None, "embed": "fsdp"}; lists become tuples.
    base: rules to start from.
    field: config path for error messages.

  Returns:
    Rules where each overridden name has exactly the given mapping.
  """
  if not config:
    return tuple(base)
  if hasattr(config, "to_dict"):
    config = config.to_dict()
  from pipe_rlhf_jax.parallel.mesh import MESH_AXES

  overrides = {}
  for name, axes in config.items():
    axes = tuple(axes) if isinstance(axes, list) else axes
    for axis in _normalise_axes(axes):
      if axis not in MESH_AXES:
        raise ValueError(
            f"{field}.{name} names mesh axis {axis!r}; use one of {list(MESH_AXES)}"
            " or None")
    overrides[name] = axes
  kept = tuple((n, a) for n, a in base if n not in overrides)
  return tuple(overrides.items()) + kept
