"""Host <-> device for global arrays: each process feeds its share, reads what it needs.

Owns the two crossings between host numpy data and arrays that may span several
processes (multi-controller JAX), so that the stages and phases call one function
whether the job has one process or many:

* `put_global(host_tree, shardings)`: every process holds the same global host batch
  (the prompt pipelines are deterministic and seeded alike) and contributes only the
  rows its own devices hold, through `jax.make_array_from_process_local_data`;
* `fetch(tree)`: a host numpy copy of arrays whatever their layout. An array this process
  cannot see entirely is first gathered to a replicated copy *on its own mesh* (a
  program only the processes of that mesh run), so a stage living on a group of
  processes never waits for processes outside its group;
* `local_copy(tree)`: the same gather, kept on device: arrays this process holds wholly
  (what a multi-process stage's leader sends to another stage, `distributed.transfer`).

On one process both reduce to `jax.device_put` / `jax.device_get`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np


def _local_rows(sharding: jax.sharding.Sharding, shape: tuple[int, ...]
                ) -> tuple[int, int] | None:
  """The contiguous block [lo, hi) of leading-axis rows this process's devices hold, or
  None when they hold a non-contiguous set (then each shard is cut out separately)."""
  spans = sorted({(idx[0].start or 0, shape[0] if idx[0].stop is None else idx[0].stop)
                  for idx in sharding.addressable_devices_indices_map(shape).values()})
  lo, hi = spans[0]
  for start, stop in spans[1:]:
    if start > hi:
      return None
    hi = max(hi, stop)
  return lo, hi


def _put_leaf(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  x = np.asarray(x)
  if sharding.is_fully_addressable:
    return jax.device_put(x, sharding)
  if x.ndim == 0:
    return jax.make_array_from_callback((), sharding, lambda _: x)
  # Only the leading (batch) axis is split across processes in the layouts built here;
  # the other axes of a process's block are whole.
  rows = _local_rows(sharding, x.shape)
  if rows is None:
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
  lo, hi = rows
  return jax.make_array_from_process_local_data(sharding, x[lo:hi], x.shape)


def put_global(tree: Any, shardings: Any) -> Any:
  """Places a host pytree on `shardings` (one Sharding, or a matching pytree of them).

  Every process passes the same global values; each uploads only its devices' share.
  """
  leaves, treedef = jax.tree.flatten(tree)
  if isinstance(shardings, jax.sharding.Sharding):
    targets = [shardings] * len(leaves)
  else:
    targets = treedef.flatten_up_to(shardings)
  return jax.tree.unflatten(treedef, [_put_leaf(x, s) for x, s in zip(leaves, targets)])


@functools.lru_cache(maxsize=64)
def _gather_on(mesh: jax.sharding.Mesh):
  """One jitted identity per mesh: a fresh `jax.jit` per call would retrace every fetch."""
  return jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, PartitionSpec()))


def _replicated_copy(x: jax.Array) -> jax.Array:
  """`x` gathered to every device of its own mesh (only that mesh's processes run it)."""
  return _gather_on(x.sharding.mesh)(x)


def local_copy(tree: Any) -> Any:
  """Each array of `tree` as one this process holds wholly, on its devices.

  Fully addressable arrays pass through; an array spanning processes is gathered within
  its own mesh (so, as for `fetch`, every process of that mesh must call this on it in
  the same order) and this process's replica (one device) is returned.
  """
  def one(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return x
    if not x.is_fully_replicated:
      if not isinstance(x.sharding, NamedSharding):
        raise TypeError(f"local_copy: an array spanning several processes needs a "
                        f"NamedSharding to be gathered, got {x.sharding!r}.")
      x = _replicated_copy(x)
    return x.addressable_data(0)
  return jax.tree.map(one, tree)


def fetch(tree: Any) -> Any:
  """Host numpy copy of a pytree of arrays (non-arrays pass through).

  Arrays this process holds entirely (or fully replicated ones) are read directly;
  others are gathered within their mesh first, so every process of that mesh must call
  `fetch` on them in the same order (as it runs every program of its stage).
  """
  def one(x):
    if not isinstance(x, jax.Array):
      return x
    if not (x.is_fully_addressable or x.is_fully_replicated):
      if not isinstance(x.sharding, NamedSharding):
        raise TypeError(f"fetch: an array spanning several processes needs a "
                        f"NamedSharding to be gathered, got {x.sharding!r}.")
      x = _replicated_copy(x)
    if x.is_fully_addressable:
      return np.asarray(jax.device_get(x))
    return np.asarray(x.addressable_data(0))
  return jax.tree.map(one, tree)
