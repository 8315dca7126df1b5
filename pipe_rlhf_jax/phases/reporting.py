"""The end of a run: the Hugging Face export, the reward plot, samples and the summary.

`report` turns a finished PPO phase into the run's files (process 0 alone writes them)
and `train`'s `JobResult`; `plot_reward_curve` draws the reward against the step from
the metrics log, `format_summary` writes the end-of-run text, and
`planned_vs_measured` and `reward_summary` are its summary lines; `export_policy` writes
the export so that it replaces the previous one whole. Split from job.py, which owns the
phases' order.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import shutil
import time
from typing import Any, Iterable, Mapping, Sequence

from flax import nnx
import numpy as np

from pipe_rlhf_jax import distributed
from pipe_rlhf_jax import metrics as metrics_lib
from pipe_rlhf_jax.checks import check_int
from pipe_rlhf_jax.concurrency.tracing import Tracer, steady_step_time
from pipe_rlhf_jax.config import PlannedRun
from pipe_rlhf_jax.models import hf
from pipe_rlhf_jax.phases import heldout
from pipe_rlhf_jax.phases.run_state import BuiltSystem, JobResult, RunSetup


def planned_vs_measured(planned: PlannedRun | None, tracer: Tracer,
                        writer: metrics_lib.MetricsWriter) -> dict[str, str]:
  """The planner's predicted steady s/step next to the trace's measured one: a metrics
  row (phase "plan") and the summary's line."""
  if planned is None:
    return {}
  measured = steady_step_time(tracer)
  row = {"plan/predicted_step_s": planned.predicted_step_s}
  if measured is not None:
    row["plan/measured_step_s"] = measured
  writer.write(0, row, phase="plan")
  text = f"{planned.predicted_step_s:.4g} predicted ({planned.hardware}, " + (
      "planner's choice" if planned.chosen else "hand-written plan") + ") / " + (
      f"{measured:.4g} measured" if measured is not None else "not measured (< 2 steps)")
  return {"steady s/step": text}


def reward_summary(warm: dict[str, Any], stats=None) -> dict[str, str]:
  """The summary lines about the reward: the reward model's held-out accuracy, if any, and
  the statistics its scores were standardised by (`phases.reward_norm`), if they were."""
  if warm["rm_eval"] is None:
    return {"reward model": "none (a rule or the environment gives the reward)"}
  lines = {"reward model held-out accuracy": f"{warm['rm_eval']['eval_accuracy']:.3f}"}
  if stats is not None:
    lines["reward standardised by"] = (f"score mean {stats.mean:.4g}, std {stats.std:.4g} "
                                       f"over {stats.samples} answers of the warm-start "
                                       "policy")
  return lines


def export_policy(model, export_dir: str) -> None:
  """Writes `model` in Hugging Face format to `export_dir`, replacing a previous export
  only once the new one is complete. A model with LoRA adapters is written merged, and
  its adapters alone in peft's layout under `<export_dir>/adapter`.

  The files are written to `<export_dir>.partial` beside it; then the previous export is
  renamed to `<export_dir>.previous`, the new one renamed into place, and the previous
  one deleted. A run stopped at any point leaves the previous export or the new one,
  never a half-written one: stopped between the two renames, the previous export waits
  under `.previous`, and the next export first puts it back.
  """
  partial, previous = export_dir + ".partial", export_dir + ".previous"
  if os.path.isdir(previous) and not os.path.isdir(export_dir):
    os.rename(previous, export_dir)
  for stale in (partial, previous):
    shutil.rmtree(stale, ignore_errors=True)
  try:
    hf.save_pretrained(model, partial)
    if model.config.lora_rank:  # the adapters alone too, for peft on the base model
      hf.save_adapters(model, os.path.join(partial, "adapter"))
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)
    raise
  if os.path.isdir(export_dir):
    os.rename(export_dir, previous)
  os.rename(partial, export_dir)
  shutil.rmtree(previous, ignore_errors=True)


def report(setup: RunSetup, built: BuiltSystem, warm: dict[str, Any], tracer: Tracer,
           writer: metrics_lib.MetricsWriter, before: dict[str, heldout.HeldoutEval],
           after: dict[str, heldout.HeldoutEval],
           start_time: float) -> JobResult:
  """The Hugging Face export, the reward plot, samples.txt, summary.txt; the result.

  `before` / `after`: the held-out evaluations before and after PPO by decoding
  ("greedy", and "sampled" when on); empty on a process that does not train.
  """
  workdir, system = setup.workdir, built.system
  none = heldout.HeldoutEval([], {}, 0)
  greedy_before, greedy_after = before.get("greedy", none), after.get("greedy", none)
  samples_before, samples_after = greedy_before.samples, greedy_after.samples
  comparisons = {}
  for decoding in after:
    comparisons.update(heldout.summary_lines(before[decoding], after[decoding]))
  # Both run programs on every process holding the trainer state (all of them, except in
  # pipe mode across processes); then only the writing process writes.
  actor = distributed.fetch(system.trained_actor()) if setup.role.trains else None
  if not setup.role.writes:
    return JobResult(workdir=workdir, wall_s=time.perf_counter() - start_time,
                     summary=f"process {distributed.process_index()}: the run's files "
                             "and summary are written by process 0",
                     samples_after=samples_after, tracer=tracer)
  export_dir = os.path.join(workdir, "export")
  export_policy(nnx.merge(built.actor_graphdef, actor), export_dir)
  plot = None
  records = metrics_lib.read_metrics(writer.metrics_path)
  if any(r.get("phase") == "ppo" for r in records):
    plot = plot_reward_curve(writer.metrics_path,
                                         os.path.join(workdir, "reward_curve.png"))
  wall = time.perf_counter() - start_time
  step_s = planned_vs_measured(setup.planned, tracer, writer)
  with open(os.path.join(workdir, "samples.txt"), "w", encoding="utf-8") as f:
    f.write("before PPO:\n  " + "\n  ".join(samples_before) + "\n")
    f.write("after PPO:\n  " + "\n  ".join(samples_after) + "\n")
  summary_text = format_summary(
      records, wall_time_s=wall, metrics_path=writer.metrics_path,
      tensorboard_dir=writer.tensorboard_dir, checkpoint_dir=setup.checkpointer.directory,
      plot_path=plot, export_dir=export_dir,
      extra={"mode": system.mode, **reward_summary(warm, built.reward_stats), **comparisons,
             "busy fraction": json.dumps({k: round(v, 3) for k, v in
                                          tracer.busy_fraction().items()}),
             "plan": str(system.plan), **step_s})
  with open(os.path.join(workdir, "summary.txt"), "w", encoding="utf-8") as f:
    f.write(summary_text + "\n\nsamples before PPO:\n  " + "\n  ".join(samples_before)
            + "\nsamples after PPO:\n  " + "\n  ".join(samples_after) + "\n")
  ppo_records = [r for r in records if r.get("phase") == "ppo"]
  sampled = None
  if "sampled" in after:
    sampled = {"samples_per_prompt": after["sampled"].samples_per_prompt,
               "before": before["sampled"].scores, "after": after["sampled"].scores,
               "per_prompt": {"before": before["sampled"].per_prompt,
                              "after": after["sampled"].per_prompt}}
  return JobResult(
      workdir=workdir, summary=summary_text, wall_s=wall, ppo_metrics=ppo_records,
      rm_eval=warm["rm_eval"],
      reward_stats=(dataclasses.asdict(built.reward_stats)
                    if built.reward_stats is not None else None),
      samples_before=samples_before, samples_after=samples_after,
      heldout_before=greedy_before.scores, heldout_after=greedy_after.scores,
      heldout_per_prompt={"before": greedy_before.per_prompt,
                          "after": greedy_after.per_prompt},
      heldout_prompts=greedy_after.num_prompts if greedy_after.scores else 0,
      heldout_sampled=sampled, busy_fraction=tracer.busy_fraction(), tracer=tracer)


# ------------------------------------------------------------- the plot and the summary


def _series(
    records: Iterable[Mapping[str, Any]], key: str, phase: str | None
) -> tuple[np.ndarray, np.ndarray]:
  """Returns (steps, values) for `key`, skipping records without a value."""
  steps, values = [], []
  for r in records:
    if phase is not None and r.get("phase") != phase:
      continue
    v = r.get(key)
    if v is None:
      continue
    steps.append(r["step"])
    values.append(float(v))
  return np.asarray(steps, np.int64), np.asarray(values, np.float64)


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
  """Trailing moving average; the first points average what exists so far.

  Args:
    values: 1-D series. # [n]
    window: Number of points averaged (>= 1).

  Returns:
    Smoothed series of the same length. # [n]
  """
  check_int(window, "window")
  values = np.asarray(values, np.float64)
  csum = np.concatenate([[0.0], np.cumsum(values)])
  idx = np.arange(1, len(values) + 1)
  lo = np.maximum(idx - window, 0)
  return (csum[idx] - csum[lo]) / (idx - lo)


def plot_reward_curve(
    metrics_jsonl: metrics_lib.PathLike,
    png_path: metrics_lib.PathLike,
    key: str = "reward/mean",
    phase: str = "ppo",
    smoothing_window: int | None = None,
) -> pathlib.Path:
  """Plots `key` against step (raw and smoothed) to a PNG.

  Args:
    metrics_jsonl: Metrics log file (or the workdir containing it).
    png_path: Output image path; parent directories are created.
    key: Metric to plot.
    phase: Only records of this phase are used.
    smoothing_window: Moving-average window; default ~1/10 of the points.

  Returns:
    The path of the written PNG.

  Raises:
    ValueError: if no record of `phase` has a finite value for `key` (the
      message lists the keys that do exist).
  """
  # The Agg canvas directly, not pyplot: no global backend switch (a notebook keeps
  # plotting inline after a run), no display needed, and safe from any thread.
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  records = metrics_lib.read_metrics(metrics_jsonl)
  steps, values = _series(records, key, phase)
  if steps.size == 0:
    available = sorted(
        {k for r in records if r.get("phase") == phase for k in r}
        - metrics_lib.RESERVED_KEYS
    )
    raise ValueError(
        f"no finite values of {key!r} in phase {phase!r} of "
        f"{metrics_lib.resolve_metrics_path(metrics_jsonl)}; keys present: {available}"
    )
  window = smoothing_window or max(1, len(values) // 10)
  smooth = moving_average(values, window)

  png_path = pathlib.Path(png_path)
  png_path.parent.mkdir(parents=True, exist_ok=True)
  fig = Figure(figsize=(7, 4))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  ax.plot(steps, values, alpha=0.35, lw=1, label="raw")
  ax.plot(steps, smooth, lw=2, label=f"moving average ({window})")
  ax.set_xlabel("step")
  ax.set_ylabel(key)
  ax.set_title(f"{key} ({phase})")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(png_path, dpi=100)
  return png_path


def _format_duration(seconds: float) -> str:
  return str(datetime.timedelta(seconds=round(seconds)))


def format_summary(
    metrics: metrics_lib.PathLike | Sequence[Mapping[str, Any]],
    *,
    key: str = "reward/mean",
    phase: str = "ppo",
    num_avg: int = 5,
    wall_time_s: float | None = None,
    metrics_path: metrics_lib.PathLike | None = None,
    tensorboard_dir: metrics_lib.PathLike | None = None,
    checkpoint_dir: metrics_lib.PathLike | None = None,
    plot_path: metrics_lib.PathLike | None = None,
    export_dir: metrics_lib.PathLike | None = None,
    extra: Mapping[str, Any] | None = None,
) -> str:
  """Builds the end-of-run text.

  Args:
    metrics: The metrics log path / workdir, or already-read records.
    key: Metric compared at start and end.
    phase: Phase whose records are used for `key`.
    num_avg: Start/end values are means over the first/last `num_avg` points
      (fewer if the run is short), so one noisy batch does not decide it.
    wall_time_s: Run wall time; default is the time span of the records.
    metrics_path: Where the metrics log is (default: `metrics` if a path).
    tensorboard_dir: TensorBoard directory, if any.
    checkpoint_dir: Checkpoint directory, if any.
    plot_path: Reward plot PNG, if any.
    export_dir: Exported model directory, if any.
    extra: More "label: value" lines appended at the end.

  Returns:
    Multi-line human-readable summary.
  """
  check_int(num_avg, "num_avg")
  if isinstance(metrics, (str, os.PathLike)):
    if metrics_path is None:
      metrics_path = metrics_lib.resolve_metrics_path(metrics)
    records = metrics_lib.read_metrics(metrics)
  else:
    records = list(metrics)

  lines = ["Run summary"]
  steps, values = _series(records, key, phase)
  if values.size:
    k = min(num_avg, values.size)
    start, end = values[:k].mean(), values[-k:].mean()
    lines.append(
        f"  {key} ({phase}): start {start:.4f} -> end {end:.4f} "
        f"(change {end - start:+.4f}; means of first/last {k} of "
        f"{values.size} logged steps, steps {steps[0]}..{steps[-1]})"
    )
  else:
    lines.append(f"  {key} ({phase}): not logged")
  if wall_time_s is None and records:
    times = [r["time"] for r in records if "time" in r]
    wall_time_s = max(times) - min(times) if times else None
  if wall_time_s is not None:
    lines.append(f"  wall time: {_format_duration(wall_time_s)} "
                 f"({wall_time_s:.1f} s)")
  for label, where in (
      ("metrics", metrics_path),
      ("tensorboard", tensorboard_dir),
      ("checkpoints", checkpoint_dir),
      ("reward plot", plot_path),
      ("exported model", export_dir),
  ):
    if where is not None:
      lines.append(f"  {label}: {where}")
  for label, value in (extra or {}).items():
    lines.append(f"  {label}: {value}")
  return "\n".join(lines)
