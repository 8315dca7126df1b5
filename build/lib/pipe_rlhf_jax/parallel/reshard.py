"""Moving pytrees between meshes and layouts: the single cross-mesh transfer point.

RLHF stages live on disjoint device groups with different layouts (e.g. train on
fsdp=4 over devices 0-3, generate on tensor=4 over devices 4-7). Every weight sync
and experience hand-off goes through `reshard`, so transfer cost is measured in one
place and reported as metrics.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np


@dataclasses.dataclass
class TransferStats:
  """What one `reshard` call moved.

  Attributes:
    bytes: logical bytes of the arrays whose layout changed (global array size,
      not counting replicas, so it is comparable across layouts).
    seconds: wall time until every moved array was ready on its target.
    num_arrays: how many leaves changed layout.
  """

  bytes: int = 0
  seconds: float = 0.0
  num_arrays: int = 0

  def as_metrics(self, prefix: str = "transfer") -> dict[str, float]:
    """Flat metrics dict, e.g. {'transfer/bytes': ..., 'transfer/seconds': ...}."""
    head = f"{prefix}/" if prefix else ""
    rate = self.bytes / self.seconds if self.seconds > 0 else 0.0
    return {
        f"{head}bytes": float(self.bytes),
        f"{head}seconds": float(self.seconds),
        f"{head}num_arrays": float(self.num_arrays),
        f"{head}bytes_per_second": float(rate),
    }

  def __add__(self, other: "TransferStats") -> "TransferStats":
    return TransferStats(self.bytes + other.bytes, self.seconds + other.seconds,
                         self.num_arrays + other.num_arrays)


def _nbytes(x: Any) -> int:
  if hasattr(x, "nbytes"):
    return int(x.nbytes)
  return int(np.asarray(x).nbytes)


def _already_placed(x: Any, target) -> bool:
  """True when `x` is a jax.Array already laid out exactly as `target`."""
  import jax

  if not isinstance(x, jax.Array):
    return False
  try:
    return (x.sharding.device_set == target.device_set and
            x.sharding.is_equivalent_to(target, x.ndim))
  except Exception:  # pylint: disable=broad-except
    # Incomparable sharding kinds: treat as a move, device_put decides.
    return False


def reshard(tree: Any, target_shardings: Any, *, donate: bool = False
            ) -> tuple[Any, TransferStats]:
  """Moves `tree` onto `target_shardings` and measures the transfer.

  Works between disjoint device sets (a train mesh and a generate mesh) because
  it uses top-level `jax.device_put`, which copies shards device to device
  rather than compiling a computation over both meshes.

  Args:
    tree: pytree of jax.Arrays (or numpy arrays / scalars, which are uploaded).
    target_shardings: a pytree of `jax.sharding.Sharding` matching `tree`, or a
      single Sharding applied to every leaf.
    donate: let the source buffers be freed after the copy (jax may ignore this,
      e.g. across device sets); do not reuse `tree` afterwards either way.

  Returns:
    (tree on the target layouts, TransferStats). Leaves already on their target
    are passed through and not counted.
  """
  import jax

  leaves, treedef = jax.tree.flatten(tree)
  if isinstance(target_shardings, jax.sharding.Sharding):
    targets = [target_shardings] * len(leaves)
  else:
    targets = treedef.flatten_up_to(target_shardings)
    for index, target in enumerate(targets):
      if not isinstance(target, jax.sharding.Sharding):
        raise TypeError(
            f"target_shardings leaf {index} is {type(target).__name__}, not a"
            " jax.sharding.Sharding; build targets with tree_shardings(...)")

  move = [i for i, (x, t) in enumerate(zip(leaves, targets))
          if not _already_placed(x, t)]
  # Wait for whatever produced the inputs so the timing covers the copy only.
  jax.block_until_ready([leaves[i] for i in move])
  start = time.perf_counter()
  moved = jax.device_put([leaves[i] for i in move], [targets[i] for i in move],
                         donate=donate)
  moved = jax.block_until_ready(moved)
  seconds = time.perf_counter() - start

  out = list(leaves)
  nbytes = 0
  for i, array in zip(move, moved):
    nbytes += _nbytes(array)
    out[i] = array
  stats = TransferStats(bytes=nbytes, seconds=seconds, num_arrays=len(move))
  return jax.tree.unflatten(treedef, out), stats
