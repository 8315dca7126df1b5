"""Device meshes: the four named axes, their sizes from config, and device splits.

Owns how a stage's devices are arranged into a `jax.sharding.Mesh` with axes
("data", "fsdp", "pipeline", "tensor"), how mesh sizes are read and validated from a
config block, and how the machine's devices are cut into disjoint contiguous groups
(one per RLHF stage). Nothing here touches devices at import time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import math
from typing import Any

import numpy as np

from pipe_rlhf_jax.checks import check_int

# Tensor is innermost so tensor-parallel peers are neighbouring device ids, which
# on real hardware share the fastest links (same host / NVLink island). Pipe sits
# just outside it: stage-to-stage traffic is point-to-point and small per tick.
MESH_AXES: tuple[str, ...] = ("data", "fsdp", "pipeline", "tensor")


def _as_plain_dict(config: Any, field: str) -> dict[str, Any]:
  """Turns a dict / ConfigDict / FrozenConfigDict into a plain dict."""
  if config is None:
    return {}
  if hasattr(config, "to_dict"):  # ml_collections.ConfigDict resolves references.
    return dict(config.to_dict())
  if isinstance(config, Mapping):
    return dict(config)
  raise TypeError(
      f"{field} must be a mapping like {{'data': 2, 'tensor': 4}}, got"
      f" {type(config).__name__}")


def _as_size(value: Any, key: str, field: str) -> int:
  """Validates one axis size: a positive int, or -1 for 'all remaining'."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(
        f"{field}.{key} must be an int (or -1 for all remaining devices), got"
        f" {value!r}")
  value = int(value)
  if value != -1 and value < 1:
    raise ValueError(
        f"{field}.{key} = {value} is not a valid mesh size; use a positive int"
        " or -1 for all remaining devices")
  return value


@dataclasses.dataclass(frozen=True)
class MeshShape:
  """Sizes of the four mesh axes. Size-1 axes are harmless no-ops.

  Attributes:
    data: pure data parallelism (replicated params, split batch).
    fsdp: data parallelism with params/optimizer state sharded (ZeRO-3 style).
    tensor: Megatron-style tensor parallelism over heads / mlp / vocab.
    pipeline: pipeline stages (layer groups); used by pipelined generation.
  """

  data: int = 1
  fsdp: int = 1
  tensor: int = 1
  pipeline: int = 1

  def __post_init__(self):
    for key in MESH_AXES:
      value = getattr(self, key)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"MeshShape.{key} must be an int, got {value!r}")
      if value < 1:
        raise ValueError(
            f"MeshShape.{key} = {value} must be >= 1; use"
            " MeshShape.from_config to resolve -1")

  @property
  def size(self) -> int:
    """Number of devices the mesh needs."""
    return self.data * self.fsdp * self.tensor * self.pipeline

  def axis_sizes(self) -> tuple[int, ...]:
    """Sizes in MESH_AXES order (data, fsdp, pipeline, tensor)."""
    return tuple(getattr(self, key) for key in MESH_AXES)

  def as_dict(self) -> dict[str, int]:
    """Sizes keyed by axis name, in MESH_AXES order."""
    return {key: getattr(self, key) for key in MESH_AXES}

  @classmethod
  def from_config(cls,
                  config: Any,
                  num_devices: int | None = None,
                  field: str = "mesh") -> "MeshShape":
    """Reads and validates mesh sizes from a config block.

    Args:
      config: dict or ConfigDict with any subset of data/fsdp/tensor/pipeline.
        Missing axes default to 1. At most one value may be -1, meaning "all
        devices not used by the other axes".
      num_devices: devices the mesh must cover exactly; defaults to
        `jax.device_count()`.
      field: dotted config path used in error messages, e.g.
        "stages.generate.mesh".

    Returns:
      A MeshShape whose product equals `num_devices`.

    Raises:
      ValueError: unknown keys, bad sizes, several -1, or a product that does not
        match the device count. The message names `field` and the fix.
    """
    values = _as_plain_dict(config, field)
    unknown = sorted(set(values) - set(MESH_AXES))
    if unknown:
      raise ValueError(
          f"{field} has unknown mesh axes {unknown}; valid keys are"
          f" {list(MESH_AXES)}")
    sizes = {key: _as_size(values.get(key, 1), key, field) for key in MESH_AXES}
    if num_devices is None:
      import jax  # Local: keep module import free of backend initialisation.
      num_devices = jax.device_count()
    check_int(num_devices, f"num_devices (for {field})")

    wildcards = [key for key, value in sizes.items() if value == -1]
    if len(wildcards) > 1:
      raise ValueError(
          f"{field} has -1 for several axes {wildcards}; at most one axis may be"
          " -1 (all remaining devices)")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    product_text = "*".join(MESH_AXES)
    if wildcards:
      key = wildcards[0]
      if num_devices % fixed:
        raise ValueError(
            f"{field}: the axes other than {key} multiply to {fixed}, which does"
            f" not divide the {num_devices} devices given, so {key}=-1 cannot be"
            f" resolved; make the other axes' product divide {num_devices}")
      sizes[key] = num_devices // fixed
    elif fixed != num_devices:
      raise ValueError(
          f"{field}: {product_text} = {fixed} but {num_devices} devices were"
          f" given; make the product {num_devices} (or set one axis to -1) or"
          f" give {fixed} devices")
    return cls(**sizes)


def make_mesh(shape: MeshShape | Mapping[str, int],
              devices: Sequence[Any] | None = None):
  """Builds a Mesh with axes MESH_AXES on an explicit list of devices.

  Args:
    shape: a MeshShape, or a mapping accepted by `MeshShape.from_config`.
    devices: the devices to use, in order; defaults to all `jax.devices()`.
      They are reshaped row-major into (data, fsdp, pipeline, tensor), so
      consecutive devices end up on the same tensor group.

  Returns:
    A `jax.sharding.Mesh` with Auto axis types (so sharding constraints and
    GSPMD propagation apply).
  """
  import jax

  if devices is None:
    devices = jax.devices()
  devices = list(devices)
  if not isinstance(shape, MeshShape):
    shape = MeshShape.from_config(shape, num_devices=len(devices))
  if shape.size != len(devices):
    raise ValueError(
        f"mesh {shape.as_dict()} needs {shape.size} devices but {len(devices)}"
        f" were given; pass exactly {shape.size} devices or change the sizes")
  if len({id(d) for d in devices}) != len(devices):
    raise ValueError("devices for make_mesh contain duplicates; pass each once")
  grid = np.empty(len(devices), dtype=object)
  grid[:] = devices
  grid = grid.reshape(shape.axis_sizes())
  axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  return jax.sharding.Mesh(grid, MESH_AXES, axis_types=axis_types)


def split_devices(devices: Sequence[Any],
                  sizes: Mapping[str, int]) -> dict[str, list[Any]]:
  """Cuts devices into disjoint contiguous groups, in the mapping's order.

  Args:
    devices: all available devices, in order.
    sizes: group name -> number of devices, e.g.
      {"generate": 4, "infer": 2, "train": 2}. Devices left over are unused.

  Returns:
    group name -> list of devices (contiguous slices of `devices`).

  Raises:
    ValueError: a non-positive size, or sizes summing past len(devices).
  """
  devices = list(devices)
  for name, size in sizes.items():
    check_int(size, f"device count for {name!r}")
  total = sum(int(s) for s in sizes.values())
  if total > len(devices):
    listing = " + ".join(f"{name}={size}" for name, size in sizes.items())
    raise ValueError(
        f"device split {listing} = {total} exceeds the {len(devices)} available"
        f" devices; shrink the groups to sum to at most {len(devices)}")
  groups, start = {}, 0
  for name, size in sizes.items():
    groups[name] = devices[start:start + int(size)]
    start += int(size)
  return groups


def _format_ids(ids: list[int]) -> str:
  """[0, 1, 2, 3] -> '[0..3]'; anything non-contiguous is listed in full."""
  if len(ids) > 1 and ids == list(range(ids[0], ids[0] + len(ids))):
    return f"[{ids[0]}..{ids[-1]}]"
  return "[" + ",".join(str(i) for i in ids) + "]"


def describe(mesh) -> str:
  """Short one-line description, e.g. 'data=2 fsdp=1 pipeline=1 tensor=4 on devices [0..7]'.

  An abstract mesh (a plan being checked, no devices yet) is described by its axes alone.
  """
  from jax.sharding import AbstractMesh
  axes = " ".join(f"{name}={size}" for name, size in mesh.shape.items())
  if isinstance(mesh, AbstractMesh):
    return axes
  ids = [int(d.id) for d in np.asarray(mesh.devices).flat]
  return f"{axes} on devices {_format_ids(ids)}"
