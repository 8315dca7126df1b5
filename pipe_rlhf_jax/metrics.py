"""Metrics output of a run: JSON lines, TensorBoard, W&B, the progress bar.

Owns the writing and reading of per-step scalars:

* `to_python`: pulls a (possibly nested) dict of device scalars to the host in
  ONE `jax.device_get`, so logging never issues a transfer per scalar.
* `MetricsWriter`: appends one JSON line per `write` to
  `workdir/metrics.jsonl` (the source of truth that tests and plots read),
  mirrors scalars to TensorBoard (tensorboardX) and, if asked and installed,
  to Weights & Biases. Non-finite values never crash a run: they are written
  as JSON `null` and listed under `NONFINITE_KEY`.
* `read_metrics`: reading the log back (the run's report draws and summarises it:
  `phases/reporting.py`); `drop_metrics`: removing the rows a resumed run is about to
  write again (atomically).
* `ProgressBar`: a thin tqdm wrapper that shows a few live values; `say`: a milestone
  line printed whatever the logging verbosity (tagged with the process in multi-process
  jobs).

Metric names are slash separated ("reward/mean"); TensorBoard tags are
f"{phase}/{name}" so that the stages of the asynchronous system (which may
write from different threads; `write` is thread-safe) stay apart.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from pipe_rlhf_jax import distributed

logger = logging.getLogger(__name__)

METRICS_FILENAME = "metrics.jsonl"
TENSORBOARD_DIRNAME = "tensorboard"
# Key under which a record lists the metrics whose value was NaN/inf.
NONFINITE_KEY = "nonfinite_metrics"
RESERVED_KEYS = frozenset({"step", "phase", "time", NONFINITE_KEY})

PathLike = str | os.PathLike


def say(message: str) -> None:
  """A milestone the user should see, whatever the logging verbosity."""
  who = (f" p{distributed.process_index()}/{distributed.process_count()}"
         if distributed.process_count() > 1 else "")
  print(f"[pipe_rlhf_jax{who}] {message}", flush=True)


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """Flattens nested mappings into one level with "/"-joined keys."""
  flat: dict[str, Any] = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      flat.update(_flatten(value, prefix=f"{name}/"))
    else:
      flat[name] = value
  return flat


def to_python(metrics_pytree: Mapping[str, Any]) -> dict[str, float]:
  """Converts a dict of (device) scalars to plain Python floats on the host.

  The whole dict is fetched with a single `jax.device_get`: one host sync per
  logging call instead of one per scalar, which matters when metrics live on
  a mesh whose stage is still running.

  Args:
    metrics_pytree: Mapping from name to a scalar (Python number, numpy or
      jax array with exactly one element). Nested mappings are flattened with
      "/" joined keys, e.g. {"reward": {"mean": x}} -> {"reward/mean": x}.

  Returns:
    Dict from flat metric name to float (NaN/inf are kept as float values).

  Raises:
    ValueError: if a value has more than one element (reduce it first).
    TypeError: if `metrics_pytree` is not a mapping or a value is not numeric.
  """
  if not isinstance(metrics_pytree, Mapping):
    raise TypeError(
        f"metrics must be a mapping of name -> scalar, got {type(metrics_pytree)}"
    )
  flat = _flatten(metrics_pytree)
  import jax  # Deferred so importing this module never initialises jax.

  host = jax.device_get(flat)
  out: dict[str, float] = {}
  for name, value in host.items():
    arr = np.asarray(value)
    if arr.size != 1:
      raise ValueError(
          f"metric {name!r} has shape {arr.shape}; metrics must be scalars "
          "(reduce it, e.g. with .mean(), before logging)."
      )
    try:
      out[name] = float(arr.reshape(()))
    except (TypeError, ValueError) as e:
      raise TypeError(
          f"metric {name!r} is not numeric (dtype {arr.dtype})."
      ) from e
  return out


class MetricsWriter:
  """Writes per-step scalar metrics to JSON lines, TensorBoard and W&B.

  Usage:
    with MetricsWriter(workdir) as writer:
      writer.write(step, {"reward/mean": r, "kl": kl}, phase="ppo")

  Attributes:
    workdir: Directory holding `metrics.jsonl` and `tensorboard/`.
    metrics_path: Path of the JSON lines file.
    tensorboard_dir: TensorBoard log directory, or None when disabled.
  """

  def __init__(
      self,
      workdir: PathLike,
      *,
      use_tensorboard: bool = True,
      use_wandb: bool = False,
      wandb_project: str | None = None,
      config: Mapping[str, Any] | None = None,
  ):
    """Opens the outputs (appending if the run is resumed in the same workdir).

    Args:
      workdir: Run directory; created if missing.
      use_tensorboard: Also write TensorBoard event files via tensorboardX.
      use_wandb: Also log to Weights & Biases if the `wandb` package imports;
        otherwise a warning is logged and the run continues without it.
      wandb_project: W&B project name (only used with `use_wandb`).
      config: Run configuration recorded by W&B (JSON-friendly mapping or
        ConfigDict).
    """
    self.workdir = pathlib.Path(workdir)
    self.workdir.mkdir(parents=True, exist_ok=True)
    self.metrics_path = self.workdir / METRICS_FILENAME
    self._lock = threading.Lock()
    self._file = open(self.metrics_path, "a", encoding="utf-8")
    self._closed = False

    self._tb = None
    self.tensorboard_dir: pathlib.Path | None = None
    if use_tensorboard:
      try:
        import tensorboardX  # pylint: disable=g-import-not-at-top

        self.tensorboard_dir = self.workdir / TENSORBOARD_DIRNAME
        self._tb = tensorboardX.SummaryWriter(logdir=str(self.tensorboard_dir))
      except ImportError:
        logger.warning("tensorboardX is not installed: TensorBoard disabled.")

    self._wandb_run = None
    if use_wandb:
      try:
        import wandb  # pylint: disable=g-import-not-at-top
      except ImportError:
        logger.warning(
            "use_wandb=True but the `wandb` package is not installed; "
            "continuing without Weights & Biases (pip install wandb)."
        )
      else:
        if config is not None and hasattr(config, "to_dict"):
          config = config.to_dict()
        try:
          self._wandb_run = wandb.init(
              project=wandb_project,
              config=dict(config) if config is not None else None,
              dir=str(self.workdir),
          )
        except Exception as e:  # pylint: disable=broad-except
          # A logging backend must never take the training run down.
          logger.warning("wandb.init failed (%s); continuing without it.", e)

  def write(
      self,
      step: int,
      metrics: Mapping[str, Any],
      phase: str = "ppo",
  ) -> dict[str, Any]:
    """Records one step of metrics.

    Args:
      step: Global step the metrics belong to.
      metrics: Mapping of name to scalar (float, numpy or jax scalar);
        nested mappings are flattened with "/".
      phase: Which part of the run produced them ("ppo", "generate", "sft",
        ...); becomes the TensorBoard tag prefix.

    Returns:
      The JSON record that was written (non-finite values as None).

    Raises:
      ValueError: on a reserved metric name ("step", "phase", "time",
        NONFINITE_KEY), a non-scalar value, or after `close()`.
    """
    values = to_python(metrics)
    clash = RESERVED_KEYS.intersection(values)
    if clash:
      raise ValueError(
          f"metric names {sorted(clash)} are reserved for the record itself; "
          "rename them."
      )
    record: dict[str, Any] = {
        "step": int(step),
        "phase": str(phase),
        "time": time.time(),
    }
    nonfinite = sorted(k for k, v in values.items() if not math.isfinite(v))
    for name, value in values.items():
      record[name] = value if math.isfinite(value) else None
    if nonfinite:
      record[NONFINITE_KEY] = nonfinite
      logger.warning(
          "step %d (%s): non-finite metrics %s written as null.",
          step, phase, nonfinite,
      )

    with self._lock:
      if self._closed:
        raise ValueError(f"MetricsWriter for {self.workdir} is closed.")
      # allow_nan=False guarantees the file stays strict JSON.
      self._file.write(json.dumps(record, allow_nan=False) + "\n")
      # Flushed per line so a crash loses at most the line being written.
      self._file.flush()
      if self._tb is not None:
        for name, value in values.items():
          self._tb.add_scalar(f"{phase}/{name}", value, global_step=int(step))
      if self._wandb_run is not None:
        try:
          self._wandb_run.log(
              {f"{phase}/{k}": v for k, v in values.items()}, step=int(step)
          )
        except Exception as e:  # pylint: disable=broad-except
          logger.warning("wandb log failed (%s); disabling wandb.", e)
          self._wandb_run = None
    return record

  def flush(self) -> None:
    """Flushes all outputs to disk."""
    with self._lock:
      if not self._closed:
        self._file.flush()
        if self._tb is not None:
          self._tb.flush()

  def close(self) -> None:
    """Flushes and closes all outputs; safe to call twice."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      self._file.close()
      if self._tb is not None:
        self._tb.close()
      if self._wandb_run is not None:
        try:
          self._wandb_run.finish()
        except Exception as e:  # pylint: disable=broad-except
          logger.warning("wandb finish failed: %s", e)

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def resolve_metrics_path(path: PathLike) -> pathlib.Path:
  p = pathlib.Path(path)
  return p / METRICS_FILENAME if p.is_dir() else p


def read_metrics(path: PathLike) -> list[dict[str, Any]]:
  """Reads a metrics log back.

  Args:
    path: The `metrics.jsonl` file, or the workdir that contains it.

  Returns:
    The records in file order, each a dict with "step", "phase", "time" and
    the metric values (None where the value was non-finite).

  Raises:
    FileNotFoundError: if the file does not exist.
    ValueError: if a line other than the last is not valid JSON. A broken
      last line (a crash in the middle of a write) is skipped with a warning.
  """
  p = resolve_metrics_path(path)
  if not p.exists():
    raise FileNotFoundError(f"no metrics log at {p}")
  lines = p.read_text(encoding="utf-8").splitlines()
  records = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError as e:
      if i == len(lines) - 1:
        logger.warning("%s: skipping truncated last line %d.", p, i + 1)
        continue
      raise ValueError(f"{p}: line {i + 1} is not valid JSON: {e}") from e
  return records


def drop_metrics(path: PathLike, drop: Callable[[Mapping[str, Any]], bool]) -> int:
  """Removes the records for which `drop(record)` is true from a metrics log, atomically.

  A resumed run rewrites the steps after its checkpoint; their rows from the run that
  crashed must go first, or the log, the plot and the summary count those steps twice.
  The kept lines are copied byte for byte into a temporary file beside the log, which
  then replaces it (`os.replace`): a crash during the rewrite leaves the old log whole.
  A broken last line (a crash in the middle of a write) is dropped too: appending after
  it would make it a broken line in the middle of the file.

  Args:
    path: The `metrics.jsonl` file, or the workdir that contains it; a missing file is
      nothing to do.
    drop: Predicate on a parsed record.

  Returns:
    The number of lines removed.

  Raises:
    ValueError: if a line other than the last is not valid JSON (nothing is changed).
  """
  p = resolve_metrics_path(path)
  if not p.exists():
    return 0
  lines = p.read_text(encoding="utf-8").splitlines(keepends=True)
  kept = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      if i == len(lines) - 1:
        logger.warning("%s: dropping truncated last line %d.", p, i + 1)
        continue
      raise ValueError(f"{p}: line {i + 1} is not valid JSON: {e}") from e
    if not drop(record):
      kept.append(line if line.endswith("\n") else line + "\n")
  removed = len([line for line in lines if line.strip()]) - len(kept)
  if removed:
    tmp = p.with_name(f".{p.name}.rewrite")
    with open(tmp, "w", encoding="utf-8") as f:
      f.writelines(kept)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, p)
  return removed


class ProgressBar:
  """tqdm progress bar showing a few live metric values.

  tqdm disables itself when stderr is not a terminal (`disable=None`); every
  method still works then, so callers never branch on it.
  """

  def __init__(
      self,
      total: int,
      desc: str = "",
      *,
      keys: Sequence[str] = ("reward/mean", "kl/mean", "kl"),
      disable: bool | None = None,
      initial: int = 0,
  ):
    """Creates the bar.

    Args:
      total: Number of steps of the run.
      desc: Text in front of the bar.
      keys: Metric names shown as postfix when present in `update` metrics.
      disable: True/False to force; None disables when not a TTY.
      initial: Starting count (e.g. the step restored from a checkpoint).
    """
    from tqdm import auto as tqdm_auto  # pylint: disable=g-import-not-at-top

    self.keys = tuple(keys)
    self.n = int(initial)
    self.postfix: dict[str, float] = {}
    self._bar = tqdm_auto.tqdm(
        total=total, desc=desc, disable=disable, initial=initial,
        dynamic_ncols=True,
    )

  def update(self, metrics: Mapping[str, Any] | None = None, n: int = 1) -> None:
    """Advances the bar by `n` and shows the selected metric values.

    Args:
      metrics: Latest metrics (device or host scalars); only `keys` are shown.
      n: Steps to advance.
    """
    self.n += n
    if metrics:
      chosen = {k: metrics[k] for k in self.keys if k in metrics}
      if chosen:
        self.postfix = to_python(chosen)
        self._bar.set_postfix(
            {k: f"{v:.4g}" for k, v in self.postfix.items()}, refresh=False
        )
    self._bar.update(n)

  def close(self) -> None:
    self._bar.close()

  def __enter__(self) -> "ProgressBar":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class SecondaryWriter:
  """The metrics writer of a process other than the primary in a multi-process job.

  Process 0 owns the run's files; every other process computes the same records (its
  metrics are the same global values) and `write` checks and returns them exactly like
  `MetricsWriter.write`, but writes nothing, so the log holds each row once.

  Attributes:
    metrics_path: the primary's `metrics.jsonl` (the workdir is shared).
    tensorboard_dir: None.
  """

  def __init__(self, workdir: PathLike):
    self.workdir = pathlib.Path(workdir)
    self.metrics_path = self.workdir / METRICS_FILENAME
    self.tensorboard_dir = None

  def write(self, step: int, metrics: Mapping[str, Any], phase: str = "ppo"
            ) -> dict[str, Any]:
    values = to_python(metrics)
    clash = RESERVED_KEYS.intersection(values)
    if clash:
      raise ValueError(f"metric names {sorted(clash)} are reserved for the record itself; "
                       "rename them.")
    return {"step": int(step), "phase": str(phase), **values}

  def flush(self) -> None:
    pass

  def close(self) -> None:
    pass

  def __enter__(self) -> "SecondaryWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
