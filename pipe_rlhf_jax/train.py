"""The main job as a library function: `train(config, workdir)` runs SFT -> RM -> PPO.

The library's edge, as `main.py` is the command line's: the ConfigDict is checked and
converted here once (`experiment_of`: its typed settings, `config.ExperimentSettings`,
the model configs at the tokenizer's vocabulary, then the plan: `plan.choose='auto'`
asks the planner to choose one, 'manual' has the hand-written plan checked by it, before
anything is built or compiled), and the typed `Experiment` runs in `job.run`, where
nothing plans and nothing reads a ConfigDict.

    from pipe_rlhf_jax.train import experiment_of, train
    experiment = experiment_of(config)   # validated, frozen, with its plan
    result = train(experiment, "runs/mine")

`train(config)` does both steps; what a run writes and how it resumes: `job.py`.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from pipe_rlhf_jax import job
from pipe_rlhf_jax.config import ExperimentSettings
from pipe_rlhf_jax.metrics import say
from pipe_rlhf_jax.phases import run_data
from pipe_rlhf_jax.phases.run_state import Experiment, JobResult
from pipe_rlhf_jax.planner import auto as auto_plan


def experiment_of(config) -> Experiment:
  """The typed, planned experiment of `config` (a ConfigDict; see configs/quickstart.py).

  Raises ValueError naming the field when the config is invalid, and the planner's
  reason when no plan (or not the hand-written one) fits the devices; nothing is written.
  """
  settings = ExperimentSettings.from_config(config)
  devices = job.select_devices(settings, settings.plan.mode)
  tokenizer = run_data.run_tokenizer(settings.model)
  models = settings.model.role_configs(tokenizer)
  run_data.check_vocab(settings.model, tokenizer, models["actor"])
  planned = auto_plan.plan_run(settings, models["actor"], devices)
  say(planned.describe())
  record = auto_plan.as_run(ml_collections.FrozenConfigDict(config), planned)
  return Experiment(settings=settings, planned=planned,
                    record=ml_collections.FrozenConfigDict(record), models=models)


def _experiment(config_or_experiment) -> Experiment:
  if isinstance(config_or_experiment, Experiment):
    return config_or_experiment
  return experiment_of(config_or_experiment)


def train(config: Experiment | ml_collections.ConfigDict, workdir: str | None = None, *,
          resume: bool = False, stop_after: int | None = None,
          progress: bool = True) -> JobResult:
  """Runs the whole RLHF job; returns its `JobResult` (the summary, the PPO metrics,
  the held-out scores before and after, the trace).

  Args:
    config: an `Experiment` (`experiment_of`), or a ConfigDict it is built from.
    workdir: output directory (default `runs/<name>-<time>`).
    resume: continue from the newest PPO checkpoint in `workdir`, under any plan (mode,
      devices, meshes); the config's mathematics must match the checkpoint's.
    stop_after: stop after this many PPO steps in total (for resume tests / preemption
      drills); the schedule still assumes `ppo.steps`.
    progress: show progress bars.
  """
  return job.run(_experiment(config), workdir, resume=resume, stop_after=stop_after,
                 progress=progress)


def prepare_warm_start(config: Experiment | ml_collections.ConfigDict,
                       workdir: str | None = None, *, progress: bool = True
                       ) -> dict[str, Any]:
  """Runs only the warm-start phases (SFT, and the reward model unless the reward is a
  rule) into `<workdir>/warmstart`.

  Other runs of the same seed, model, data, sft and reward_model config start PPO from
  it with `--config.warm_start.checkpoint=<workdir>/warmstart`, whatever their plan
  mode. Restores instead of training when that checkpoint already exists.

  Returns:
    {"workdir", "checkpoint" (the warmstart directory), "rm_eval" (None with a rule
    reward)}.
  """
  return job.prepare_warm_start(_experiment(config), workdir, progress=progress)
