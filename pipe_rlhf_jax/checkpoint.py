"""Checkpointing of the training state with Orbax, with safe restore.

Owns `Checkpointer`: a thin layer over `orbax.checkpoint.CheckpointManager`
that saves, per step, two items:

* "state": a pytree of arrays (actor/critic params, optimizer states, rng key
  data, step counters, ...) written asynchronously with `StandardSave`;
* "metadata": a JSON dict (data iterator state, config fingerprint, ...).

and restores them straight into the shardings of an abstract target (so a
run can resume on a different mesh than it saved from). Orbax alone would
silently cast dtypes, silently skip a save of an existing step and report
structure problems in its own terms; here every such case raises a
`CheckpointError` that names the step directory, the offending leaf and what
to do, and nothing on disk is ever modified by a failed save or restore.

Orbax's own setting changed here (once, process-wide, on the first `Checkpointer`): the
`jax.Array` type handler writes an array replica-parallel (each replica its own slice)
only when a slice is at least `REPLICA_PARALLEL_MIN_BYTES`; see `_small_arrays_unsliced`.

Also owns `config_fingerprint`, the stable hash of the config fields that
change the mathematics (not the run plan: devices, meshes, mode), stored
in the metadata so that resuming with an incompatible config is refused
(`restore(..., expect_metadata=...)`) while a different plan is allowed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pathlib
import shutil
from typing import Any, Iterable, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

logger = logging.getLogger(__name__)

STATE_ITEM = "state"
# How Orbax names a step directory while it is being written (renamed when complete).
TMP_SUFFIX = ".orbax-checkpoint-tmp"
METADATA_ITEM = "metadata"

# Orbax saves a replicated array replica-parallel by default: every replica slices out its
# share with an eager op that jax compiles once per (shape, device). For small arrays the
# compilations cost far more than the parallel write saves (a small model's first save
# compiles one per replicated array and device: dozens for the tiny arith job on 8
# devices). Slices of at least this size keep the parallel write (a 7B model's weight
# matrices are far above it).
REPLICA_PARALLEL_MIN_BYTES = 1 << 20


@functools.cache  # once per process
def _small_arrays_unsliced() -> None:
  """Registers Orbax's `jax.Array` handler with `REPLICA_PARALLEL_MIN_BYTES`."""
  # Orbax's default handler keeps per-array metadata in a store; the replacement keeps
  # the same store so that what is written is unchanged apart from the slicing.
  default = ocp.type_handlers.get_type_handler(jax.Array)
  # Orbax warns on every override ("Type handler registry ... overriding"); this one is
  # deliberate, so that one warning is kept out of the run's output (only around it).
  absl_logger = logging.getLogger("absl")
  level = absl_logger.level
  absl_logger.setLevel(logging.ERROR)
  try:
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(
            min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES,
            array_metadata_store=getattr(default, "_array_metadata_store", None)),
        override=True)
  finally:
    absl_logger.setLevel(level)

# Fields that change where or how often things are written, or where and in which order
# the same mathematics runs, never the mathematics itself: a run may resume with other
# values. "plan", "mesh" and "stages" are the run plan (mode, device count, placement,
# meshes, queues, staleness bound): a run preempted on one slice continues on another.
# The staleness bound does change which policy generates a rollout; job.py stores the
# plan in the checkpoint and warns when a resume changes it. "warm_start" is where the
# warm start runs (its mesh) or which checkpoint it is read from: what it computes is
# decided by the seed, model, data, sft and reward_model sections, and a restored warm
# start is checked against those. (Names are matched at any depth, or as dotted paths.)
DEFAULT_FINGERPRINT_IGNORE = (
    "workdir",
    "checkpoint",
    "log",
    "name",
    "shutdown_timeout_s",
    "plan",
    "mesh",
    "stages",
    "warm_start",
)


class CheckpointError(RuntimeError):
  """A checkpoint cannot be written or restored as requested."""


class CheckpointExistsError(CheckpointError, FileExistsError):
  """Saving would overwrite an existing checkpoint step."""


def _key_name(entry: Any) -> str:
  """One path entry as a string, independent of the container type.

  Orbax stores NamedTuples (optax states) as dicts and non-string dict keys as
  strings, so paths are compared by name only.
  """
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _leaf_paths(tree: Any) -> dict[tuple[str, ...], Any]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {tuple(_key_name(e) for e in path): leaf for path, leaf in leaves}


def _fmt_path(path: tuple[str, ...]) -> str:
  return "/".join(path) if path else "<root>"


def _is_key_dtype(dtype: Any) -> bool:
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _abstract_leaf(path: Any, leaf: Any) -> jax.ShapeDtypeStruct:
  """Target leaf -> ShapeDtypeStruct with a sharding (default: device 0)."""
  sharding = getattr(leaf, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if isinstance(mesh, jax.sharding.AbstractMesh):
    # jax.eval_shape of sharded values yields shardings on an AbstractMesh,
    # which names axes but not devices: nothing can be placed on it.
    raise ValueError(
        f"restore target leaf '{_fmt_path(tuple(_key_name(e) for e in path))}'"
        " has a sharding on an AbstractMesh (typical of jax.eval_shape "
        "output); give it NamedSharding(concrete_mesh, spec), or no sharding "
        "to restore it onto the first device."
    )
  if sharding is None:
    # Without a sharding Orbax would use the saved one, which need not exist
    # on this topology; one device is the only safe default.
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def _stored_shape_dtype(leaf: jax.ShapeDtypeStruct) -> tuple[tuple, np.dtype]:
  """What the target leaf looks like on disk (typed keys are stored as data)."""
  if _is_key_dtype(leaf.dtype):
    data = jax.eval_shape(
        jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    )
    return tuple(data.shape), np.dtype(data.dtype)
  return tuple(leaf.shape), np.dtype(leaf.dtype)


def _canonical(value: Any) -> Any:
  """JSON-stable form of a config value (ordering and types normalised)."""
  if hasattr(value, "to_dict"):
    value = value.to_dict()
  if isinstance(value, Mapping):
    return {str(k): _canonical(v) for k, v in sorted(value.items(),
                                                      key=lambda kv: str(kv[0]))}
  if isinstance(value, (list, tuple)):
    return [_canonical(v) for v in value]
  if isinstance(value, np.generic):
    value = value.item()
  if isinstance(value, float):
    return repr(value)  # exact, and NaN/inf safe
  if value is None or isinstance(value, (bool, int, str)):
    return value
  return repr(value)


def _drop_ignored(tree: Any, ignore: frozenset[str], prefix: str = "") -> Any:
  if not isinstance(tree, Mapping):
    return tree
  out = {}
  for k, v in tree.items():
    dotted = f"{prefix}{k}"
    if k in ignore or dotted in ignore:
      continue
    out[k] = _drop_ignored(v, ignore, prefix=f"{dotted}.")
  return out


def fingerprinted_fields(
    config_dict: Mapping[str, Any],
    ignore: Iterable[str] = DEFAULT_FINGERPRINT_IGNORE,
) -> dict[str, Any]:
  """The fields `config_fingerprint` hashes, in canonical (JSON-stable) form.

  Stored with every checkpoint, so that a refused resume can name the fields that
  differ (`config_changes`).
  """
  if hasattr(config_dict, "to_dict"):
    config_dict = config_dict.to_dict()
  if not isinstance(config_dict, Mapping):
    raise TypeError(
        f"config_dict must be a mapping or ConfigDict, got {type(config_dict)}"
    )
  return _canonical(_drop_ignored(config_dict, frozenset(ignore)))


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(tree, Mapping):
    return {prefix: tree}
  out = {}
  for k, v in tree.items():
    out.update(_flatten(v, f"{prefix}{k}."))
  if not tree and prefix:
    out[prefix] = {}
  return {k.rstrip("."): v for k, v in out.items()}


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
  """`field: old -> new` for each fingerprinted field that differs, sorted by name.

  Args:
    saved / current: `fingerprinted_fields` of two configs.
  """
  old, new = _flatten(saved), _flatten(current)
  missing = "<absent>"
  return [f"{k}: {old.get(k, missing)} -> {new.get(k, missing)}"
          for k in sorted(set(old) | set(new)) if old.get(k, missing) != new.get(k, missing)]


def config_fingerprint(
    config_dict: Mapping[str, Any],
    ignore: Iterable[str] = DEFAULT_FINGERPRINT_IGNORE,
) -> str:
  """Stable hash of the configuration fields that change the mathematics.

  Args:
    config_dict: The run config (dict or `ml_collections.ConfigDict`, nested).
    ignore: Field names to leave out, matched against a key's own name at any
      depth ("workdir") or its dotted path from the root ("data.num_workers").

  Returns:
    16 hex characters; equal for configs that differ only in ignored fields
    or in key order.
  """
  kept = fingerprinted_fields(config_dict, ignore)
  blob = json.dumps(kept, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


class Checkpointer:
  """Saves and restores (state pytree, JSON metadata) per step with Orbax.

  Usage:
    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=3)
    ckpt.save(step, state, metadata={"config_fingerprint": fp, "data": it})
    ...
    state, meta = ckpt.restore(target=abstract_state,
                               expect_metadata={"config_fingerprint": fp})
    ckpt.close()

  Saves are asynchronous: `save` returns once the arrays are copied off the
  devices (so the caller may donate or overwrite them), the write finishes in
  the background; `wait()` blocks until it is on disk.
  """

  def __init__(
      self,
      directory: str | os.PathLike,
      *,
      max_to_keep: int | None = 3,
      async_save: bool = True,
      processes: Iterable[int] | None = None,
      cleanup: bool = True,
  ):
    """Opens (creating if needed) a checkpoint directory.

    Args:
      directory: Root directory; one sub-directory per step.
      max_to_keep: Keep only the newest N steps (None keeps all).
      async_save: Write in a background thread.
      cleanup: remove the temporary directories of saves that never finished (a kill
        during a write leaves a partial, full-size copy behind). Only for the group
        that writes: a read-only process must not delete what a writer is writing.
      processes: in a multi-process job, the processes that save and restore together
        (the first one writes the shared files); None = all of them. A group of processes
        (e.g. the training stage of a pipe-mode job) can then checkpoint while the others
        run something else. A group of one process other than process 0 can only read:
        Orbax writes host (numpy) arrays from process 0 only, and refuses device arrays
        that one process holds entirely.
    """
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(
          f"max_to_keep must be >= 1 or None (keep all), got {max_to_keep}"
      )
    self.directory = pathlib.Path(directory).absolute()
    _small_arrays_unsliced()
    multiprocessing = ocp.options.MultiprocessingOptions()
    if processes is not None:
      processes = sorted(set(processes))
      multiprocessing = ocp.options.MultiprocessingOptions(
          primary_host=processes[0], active_processes=set(processes),
          barrier_sync_key_prefix="group_" + "_".join(map(str, processes)))
    if processes is not None:
      # Orbax creates the root itself only when every process takes part.
      self.directory.mkdir(parents=True, exist_ok=True)
    # Unfinished writes of an interrupted run (Orbax renames a step's directory only
    # once it is complete), removed before the manager opens: nothing reads them, and
    # each is up to a full-size copy of the state.
    self.unfinished = []
    if cleanup and self.directory.is_dir() and jax.process_index() == (
        processes[0] if processes else 0):
      self.unfinished = sorted(p.name for p in self.directory.glob(f"*{TMP_SUFFIX}*"))
      for name in self.unfinished:
        shutil.rmtree(self.directory / name, ignore_errors=True)
      if self.unfinished:
        logger.warning("%s: removed %d unfinished checkpoint write(s) of an earlier run: "
                       "%s", self.directory, len(self.unfinished), ", ".join(self.unfinished))
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=async_save,
        create=processes is None,
        multiprocessing_options=multiprocessing,
    )
    # Handlers are registered up front so that metadata and restore work in a
    # fresh process, before any save was made through this manager.
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=options,
        item_handlers={
            STATE_ITEM: ocp.StandardCheckpointHandler(),
            METADATA_ITEM: ocp.JsonCheckpointHandler(),
        },
    )

  # -- queries ---------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """Steps with a checkpoint (including one still being written), sorted."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """Newest checkpointed step, or None if there is none."""
    return self._manager.latest_step()

  def step_dir(self, step: int) -> pathlib.Path:
    """Directory of one step's checkpoint."""
    return self.directory / str(int(step))

  # -- save ------------------------------------------------------------------

  def save(self, step: int, state: Any, *, metadata: Mapping[str, Any]) -> None:
    """Starts saving `state` and `metadata` as checkpoint `step`.

    Args:
      step: Step number (>= 0); must not exist yet.
      state: Pytree of jax/numpy arrays. Typed PRNG keys are supported.
      metadata: JSON-serialisable dict (tuples come back as lists).

    Raises:
      CheckpointExistsError: if `step` already has a checkpoint (nothing is
        deleted or modified).
      TypeError: if `metadata` is not a JSON-serialisable dict.
      ValueError: on a negative step.
    """
    step = int(step)
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    if not isinstance(metadata, Mapping):
      raise TypeError(f"metadata must be a dict, got {type(metadata)}")
    try:
      # Fail here, not in the background thread, on non-JSON metadata.
      metadata = json.loads(json.dumps(dict(metadata)))
    except (TypeError, ValueError) as e:
      raise TypeError(f"metadata is not JSON-serialisable: {e}") from e
    # Orbax silently skips (returns False) a step <= latest and would raise a
    # bare error for an existing one; refuse explicitly, checking the disk too.
    if step in self._manager.all_steps() or self.step_dir(step).exists():
      raise CheckpointExistsError(
          f"checkpoint step {step} already exists at {self.step_dir(step)}; "
          "refusing to overwrite it. Use a new step number or a new workdir."
      )
    self._manager.save(
        step,
        args=ocp.args.Composite(**{
            STATE_ITEM: ocp.args.StandardSave(state),
            METADATA_ITEM: ocp.args.JsonSave(metadata),
        }),
        force=True,  # our caller decides when to save, not a save policy
    )

  def wait(self) -> None:
    """Blocks until every started save is complete on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases resources."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- restore ---------------------------------------------------------------

  def _resolve_step(self, step: int | None) -> int:
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"no checkpoint found in {self.directory}")
      return steps[-1]
    step = int(step)
    if step not in steps:
      raise FileNotFoundError(
          f"no checkpoint for step {step} in {self.directory} "
          f"(available steps: {steps})"
      )
    return step

  def _corrupt(self, step: int, what: str, err: BaseException) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {self.step_dir(step)} is corrupt or unreadable ({what}: "
        f"{type(err).__name__}: {str(err)[:500]}). The files were left as "
        "they are; restore an older step or start a new workdir."
    )

  def read_metadata(self, step: int | None = None) -> dict[str, Any]:
    """Reads only the JSON metadata of `step` (default: latest).

    Raises:
      FileNotFoundError: if there is no such checkpoint.
      CheckpointError: if the metadata cannot be read.
    """
    step = self._resolve_step(step)
    try:
      out = self._manager.restore(
          step,
          args=ocp.args.Composite(**{METADATA_ITEM: ocp.args.JsonRestore()}),
      )
      metadata = out[METADATA_ITEM]
    except Exception as e:  # pylint: disable=broad-except
      raise self._corrupt(step, "reading metadata", e) from e
    if not isinstance(metadata, dict):
      raise self._corrupt(
          step, "reading metadata", TypeError(f"got {type(metadata)}")
      )
    return metadata

  def _validate_target(self, step: int, target: Any) -> None:
    """Compares the target's structure, shapes and dtypes with the disk."""
    try:
      stored = self._manager.item_metadata(step)[STATE_ITEM]
    except Exception as e:  # pylint: disable=broad-except
      raise self._corrupt(step, "reading array metadata", e) from e
    if stored is None:
      raise self._corrupt(
          step, "reading array metadata", FileNotFoundError("metadata missing")
      )
    stored = getattr(stored, "tree", stored)
    saved = _leaf_paths(stored)
    wanted = _leaf_paths(target)
    hint = (
        "The checkpoint is incompatible with the current config: resume with "
        "the config it was written with, or use a new workdir."
    )
    missing = sorted(set(wanted) - set(saved))
    extra = sorted(set(saved) - set(wanted))
    if missing or extra:
      parts = []
      if missing:
        parts.append("leaves expected but not in the checkpoint: "
                     + ", ".join(_fmt_path(p) for p in missing[:10]))
      if extra:
        parts.append("leaves in the checkpoint but not expected: "
                     + ", ".join(_fmt_path(p) for p in extra[:10]))
      raise CheckpointError(
          f"checkpoint {self.step_dir(step)} has a different structure: "
          + "; ".join(parts) + ". " + hint
      )
    for path, leaf in wanted.items():
      meta = saved[path]
      want_shape, want_dtype = _stored_shape_dtype(leaf)
      got_shape = tuple(getattr(meta, "shape", ()))
      got_dtype = np.dtype(getattr(meta, "dtype", None))
      if got_shape != want_shape or got_dtype != want_dtype:
        raise CheckpointError(
            f"checkpoint {self.step_dir(step)}: leaf '{_fmt_path(path)}' is "
            f"saved with shape {got_shape} dtype {got_dtype} but the target "
            f"expects shape {want_shape} dtype {want_dtype}. " + hint
        )

  def restore(
      self,
      step: int | None = None,
      *,
      target: Any,
      expect_metadata: Mapping[str, Any] | None = None,
  ) -> tuple[Any, dict[str, Any]]:
    """Restores checkpoint `step` into the shardings of `target`.

    Args:
      step: Step to restore; None means the latest.
      target: Abstract pytree with the same structure as the saved state:
        `jax.ShapeDtypeStruct` leaves with `.sharding` (e.g. from
        `jax.eval_shape` plus the current mesh's shardings) or concrete
        arrays. Arrays are read directly into these shardings, which may be
        on a different mesh than at save time. A leaf without a sharding is
        placed on the first device; one on an `AbstractMesh` is an error.
      expect_metadata: Metadata entries that must match exactly (e.g.
        {"config_fingerprint": fp}).

    Returns:
      (state, metadata): the restored pytree (structure of `target`) and the
      JSON metadata dict.

    Raises:
      FileNotFoundError: no checkpoint (or not that step) in the directory.
      ValueError: a target sharding on an `AbstractMesh`.
      CheckpointError: structure/shape/dtype mismatch with `target`, a
        metadata entry different from `expect_metadata`, or a corrupt step.
        The files on disk are never modified.
    """
    step = self._resolve_step(step)
    abstract = jax.tree_util.tree_map_with_path(_abstract_leaf, target)
    metadata = self.read_metadata(step)
    for key, want in (expect_metadata or {}).items():
      got = metadata.get(key, "<missing>")
      if got != want:
        raise CheckpointError(
            f"checkpoint {self.step_dir(step)}: metadata {key!r} is {got!r} "
            f"but the current run expects {want!r}. The checkpoint is "
            "incompatible with the current config: use a new workdir or the "
            "matching config."
        )
    self._validate_target(step, abstract)
    try:
      out = self._manager.restore(
          step,
          args=ocp.args.Composite(
              **{STATE_ITEM: ocp.args.StandardRestore(abstract)}
          ),
      )
      state = out[STATE_ITEM]
    except Exception as e:  # pylint: disable=broad-except
      raise self._corrupt(step, "reading arrays", e) from e
    # Return exactly the target's tree type (NamedTuples, dataclasses, nnx
    # State), matching leaves by path name rather than by flattening order,
    # which differs between a NamedTuple and the dict Orbax may rebuild.
    restored = _leaf_paths(state)
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    state = jax.tree_util.tree_unflatten(
        treedef,
        [restored[tuple(_key_name(e) for e in p)] for p, _ in paths_and_leaves],
    )
    return state, metadata
