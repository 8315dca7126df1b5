"""What a run is asked to do (`Experiment`), what it decided before it trains
(`RunSetup`), what this process does in the job (`ProcessRole`), the PPO system it built
(`BuiltSystem`) and what it returns (`JobResult`).

The state `job.py` passes between its phases, in a module of its own below both the
phases that read it (`phases.reporting`) and `job.py`, which fills it in. `Experiment`
is built once at the edge (`train.experiment_of`, where the planner runs): below it
nothing plans.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any

from flax import nnx

from pipe_rlhf_jax import checkpoint as ckpt_lib
from pipe_rlhf_jax.concurrency.progress import ProgressDeadline
from pipe_rlhf_jax.concurrency.tracing import Tracer
from pipe_rlhf_jax.config import ExperimentSettings, Plan, PlannedRun, PPOSettings
from pipe_rlhf_jax.distributed.transfer import process_of
from pipe_rlhf_jax.generation.sampler import SamplingSettings
from pipe_rlhf_jax.models.config import TransformerConfig
from pipe_rlhf_jax.phases import reward_norm
from pipe_rlhf_jax.system.pipe_processes import stage_processes
from pipe_rlhf_jax.system.system import PPOSystem
from pipe_rlhf_jax.workdir import WorkdirLock


@dataclasses.dataclass(frozen=True)
class Experiment:
  """One run's settings, checked and converted once, with its plan already chosen.

  Built by `train.experiment_of(config)` (`config.ExperimentSettings.from_config`, the
  model configs, the planner); `job.run` and everything below it read only this, never a
  ConfigDict. A researcher with an experiment at hand passes it to `train.train` as it
  is; the ConfigDict stays at the edge.

  Attributes:
    settings: every section of the config, typed and checked (`ExperimentSettings`:
      model, data, sft, reward_model, reward, warm_start, checkpoint, log, ppo, the
      sampling, the hand-written plan and how it is chosen).
    planned: the plan the run uses and its prediction (`PlannedRun`): the planner's
      choice under `plan.choose='auto'`, the hand-written plan, checked, under 'manual';
      `plan` is the plan itself.
    record: the config as it runs, with the chosen plan's fields written in (a frozen
      ConfigDict): what config.json and the metrics' record hold, so that the workdir
      says which plan ran. Nothing reads settings from it.
    models: the model configs of the roles (actor, critic, reward) at the tokenizer's
      vocabulary.
  """

  settings: ExperimentSettings
  planned: PlannedRun
  record: Any
  models: dict[str, TransformerConfig]

  @property
  def ppo(self) -> PPOSettings:
    """The algorithm (`settings.ppo`)."""
    return self.settings.ppo

  @property
  def plan(self) -> Plan:
    """The plan the run uses (`planned.plan`)."""
    return self.planned.plan


@dataclasses.dataclass(frozen=True)
class ProcessRole:
  """What this process does in the job: the one place multi-process runs branch on.

  Attributes:
    process: its index in the job.
    writes: it writes the run's files (metrics, summary, export): process 0.
    trains: it holds the trainer state: every process, except in pipe mode across
      processes, where only the training stage's processes do.
    across: pipe mode with its stages in different processes (`system/pipe_processes.py`).
    trainers: the training stage's processes in that case (they checkpoint the trainer
      state together and vote on stopping); None otherwise (every process).
  """

  process: int = 0
  writes: bool = True
  trains: bool = True
  across: bool = False
  trainers: tuple[int, ...] | None = None

  @classmethod
  def of(cls, plan: Plan, layouts: dict[str, Any], process: int,
         processes: int, devices_per_process: int,
         owner: Callable[[Any], int] = process_of) -> "ProcessRole":
    """The role of process `process` of `processes` under the plan `plan`, whose stage
    layouts are `layouts` (`owner(device)`: a device's process); raises ValueError when
    pipe mode across processes would put the training stage outside process 0 (which
    writes the run's files) or leave a process without a stage."""
    if not (plan.mode == "pipe" and processes > 1):
      return cls(process=process, writes=process == 0)
    groups = stage_processes(layouts, owner)
    # A process of no stage would have no part in the PPO schedule, while the job's
    # collectives (checkpoints, stopping) still wait for it.
    idle = sorted(set(range(processes)) - {p for g in groups.values() for p in g})
    if idle:
      raise ValueError(
          f"plan.placement: in pipe mode across processes every process must hold a "
          f"stage, but the placement {'+'.join(map(str, plan.placement))} leaves "
          f"processes {idle} without one ({processes} processes of "
          f"{devices_per_process} devices). Give the stages more devices (e.g. "
          f"plan.placement.train a multiple of {devices_per_process}: training takes "
          f"the last devices), or start fewer processes.")
    trainers = tuple(groups["train"])
    if 0 not in trainers:
      raise ValueError(
          f"plan.placement: in pipe mode across processes the training stage must "
          f"include process 0's devices (the last block of the device order, "
          f"{devices_per_process} per process); it lies in processes {list(trainers)}. "
          f"Make plan.placement.train the last block: a multiple of "
          f"{devices_per_process} devices, or at most {devices_per_process}.")
    return cls(process=process, writes=process == 0, trains=process in trainers,
               across=True, trainers=trainers)

  @property
  def checkpoint_group(self) -> list[int] | None:
    """The processes that save and restore the trainer state with this one (None: all):
    the training group holds it; any other process only reads checkpoints (a manager
    over its own process, which writes nothing)."""
    if not self.across:
      return None
    return list(self.trainers) if self.trains else [self.process]

  @property
  def trains_alone(self) -> bool:
    """Whether the trainer state lives in this one process only."""
    return self.trainers is not None and len(self.trainers) == 1


@dataclasses.dataclass
class RunSetup:
  """What `set_up` decided before any data is built or model trained."""

  experiment: Experiment
  workdir: str
  devices: list
  tokenizer: Any
  layouts: dict[str, Any]
  checkpointer: ckpt_lib.Checkpointer
  fingerprint: str
  start: int  # first PPO step this run trains (0, or the step after the checkpoint)
  warm_layout: Any  # the warm-start phases' layout, the same in every mode
  warm_source: str | None  # the warm-start checkpoint to restore; None: train it here
  role: ProcessRole = ProcessRole()  # what this process does in a multi-process job
  lock: WorkdirLock | None = None  # held by the process that writes (process 0)
  # How long a step / a one-off wait between processes may make no progress.
  deadline: ProgressDeadline = ProgressDeadline()
  # The data.jsonl files' digests (`data.digests.file_digests`), kept in each checkpoint.
  data_files: dict[str, Any] = dataclasses.field(default_factory=dict)
  # Multi-turn episodes (`env`): their runner, its template checked at set-up; else None.
  episodes: Any = None

  @property
  def planned(self) -> PlannedRun:
    """The plan the run uses and its predicted s/step."""
    return self.experiment.planned

  @property
  def plan(self) -> Plan:
    """The plan the run uses."""
    return self.experiment.plan

  @property
  def cfgs(self) -> dict[str, TransformerConfig]:
    return self.experiment.models

  def close(self) -> None:
    """Waits for the checkpoint writes and releases the workdir."""
    try:
      self.checkpointer.close()
    finally:
      if self.lock is not None:
        self.lock.release()


@dataclasses.dataclass
class BuiltSystem:
  """The PPO system and what the before/after samples need from its construction."""

  system: PPOSystem
  sampling: SamplingSettings
  actor_graphdef: nnx.GraphDef
  # The reward model's score statistics the rewards are standardised by (None: raw).
  reward_stats: reward_norm.ScoreStatistics | None = None


@dataclasses.dataclass(frozen=True)
class JobResult:
  """What `train` returns.

  Attributes:
    workdir: the run's directory.
    summary: the run summary (as summary.txt holds it), or, on a process that does not
      write the run's files, a line saying process 0 writes them.
    wall_s: seconds from the start of `train` to the report.
    ppo_metrics: the PPO rows of metrics.jsonl, in step order (empty on a process that
      does not write).
    rm_eval: the reward model's held-out evaluation ({"eval_accuracy", ...}); None with
      a rule reward.
    reward_stats: the statistics the reward-model scores were standardised by
      ({"mean", "std", "samples"}); None when raw.
    samples_before / samples_after: the held-out greedy samples shown before and after.
    heldout_before / heldout_after: rule -> held-out greedy score before / after PPO.
    heldout_per_prompt: {"before", "after"}: rule -> each held-out prompt's greedy score
      (for `heldout.paired_change`).
    heldout_prompts: how many held-out prompts those scores average (0: none scored).
    heldout_sampled: the same for `log.eval_samples_per_prompt` sampled answers per
      prompt ({"samples_per_prompt", "before", "after", "per_prompt"}); None when off.
    busy_fraction: stage -> the fraction of the run its spans were open.
    tracer: the PPO phase's trace.
  """

  workdir: str
  summary: str
  wall_s: float
  ppo_metrics: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  rm_eval: dict[str, Any] | None = None
  reward_stats: dict[str, float] | None = None
  samples_before: list[str] = dataclasses.field(default_factory=list)
  samples_after: list[str] = dataclasses.field(default_factory=list)
  heldout_before: dict[str, float] = dataclasses.field(default_factory=dict)
  heldout_after: dict[str, float] = dataclasses.field(default_factory=dict)
  heldout_per_prompt: dict[str, dict[str, list[float]]] = dataclasses.field(
      default_factory=dict)
  heldout_prompts: int = 0
  heldout_sampled: dict[str, Any] | None = None
  busy_fraction: dict[str, float] = dataclasses.field(default_factory=dict)
  tracer: Tracer | None = None
