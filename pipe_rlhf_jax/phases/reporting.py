"""The end of a run: the Hugging Face export, the reward plot, samples and the summary.

`report` turns a finished PPO phase into the run's files (process 0 alone writes them)
and `train`'s `JobResult`; `planned_vs_measured` and `reward_summary` are its summary
lines; `export_policy` writes the export so that it replaces the previous one whole.
Split from job.py, which owns the phases' order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any

from flax import nnx

from pipe_rlhf_jax import distributed
from pipe_rlhf_jax import metrics as metrics_lib
from pipe_rlhf_jax.models import hf
from pipe_rlhf_jax.phases import heldout
from pipe_rlhf_jax.phases.run_state import BuiltSystem, JobResult, RunSetup
from pipe_rlhf_jax.runtime.tracing import Tracer, steady_step_time
from pipe_rlhf_jax.system.settings import PlannedRun


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
    return {"reward model": "none (rule reward)"}
  lines = {"reward model held-out accuracy": f"{warm['rm_eval']['eval_accuracy']:.3f}"}
  if stats is not None:
    lines["reward standardised by"] = (f"score mean {stats.mean:.4g}, std {stats.std:.4g} "
                                       f"over {stats.samples} answers of the warm-start "
                                       "policy")
  return lines


def export_policy(model, export_dir: str) -> None:
  """Writes `model` in Hugging Face format to `export_dir`, replacing a previous export
  only once the new one is complete.

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
  actor = distributed.fetch(system.state.actor) if setup.role.trains else None
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
    plot = metrics_lib.plot_reward_curve(writer.metrics_path,
                                         os.path.join(workdir, "reward_curve.png"))
  wall = time.perf_counter() - start_time
  step_s = planned_vs_measured(setup.planned, tracer, writer)
  with open(os.path.join(workdir, "samples.txt"), "w", encoding="utf-8") as f:
    f.write("before PPO:\n  " + "\n  ".join(samples_before) + "\n")
    f.write("after PPO:\n  " + "\n  ".join(samples_after) + "\n")
  summary_text = metrics_lib.format_summary(
      records, wall_time_s=wall, metrics_path=writer.metrics_path,
      tensorboard_dir=writer.tensorboard_dir, checkpoint_dir=setup.checkpointer.directory,
      plot_path=plot, export_dir=export_dir,
      extra={"mode": system.mode, **reward_summary(warm, built.reward_stats), **comparisons,
             "busy fraction": json.dumps({k: round(v, 3) for k, v in
                                          tracer.busy_fraction().items()}),
             "plan": str(system.runtime), **step_s})
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
