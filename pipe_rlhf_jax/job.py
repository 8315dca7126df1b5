"""The main job on a typed experiment: `run(experiment, workdir)` runs SFT -> RM -> PPO.

The experiment (`phases.run_state.Experiment`) comes checked and planned from the edge
(`train.experiment_of`, which `train.train` calls on a ConfigDict): nothing here plans.

With a rule reward (`reward.fn` other than "model", e.g. `arith_exact_match`) the
reward-model phase is skipped: SFT -> PPO against the rule. With `log.eval_prompts` > 0
the held-out prompts are answered greedily before and after PPO and scored by the rules
(metrics phase "heldout", and a summary line per rule).

Everything a run writes goes under `workdir`: data/ (generated task and TFDS datasets),
warmstart/ (SFT policy + reward model checkpoint), checkpoints/ (PPO), metrics.jsonl,
tensorboard/, trace.json + gantt.png (stage spans), reward_curve.png, samples.txt,
export/ (the final policy in Hugging Face format) and summary.txt.

`run` runs five phases: `set_up` (choose the devices, build and check the stage layouts
on abstract parameters, read where a resume starts with `phases.resume`: all before any
data are built), `open_metrics` + `phases.run_data.build_data` + the warm start
(`phases.warm_start`), `build_system` (the one place the PPO system is constructed),
`phases.ppo_loop` (`restore_ppo` + `PPOLoop`), and `phases.reporting.report` (with
`phases.heldout`'s greedy answers before and after PPO).

Warm start (`phases/warm_start.py`): SFT and the reward model train on a layout of their
own, the same in every mode; `warm_start.checkpoint` names another run's
`<workdir>/warmstart` to start PPO from; `prepare_warm_start` runs the warm-start phases
alone to write one.

Resume: the warm-start phases are checkpointed once, when both are done; PPO is
checkpointed every `checkpoint.every` steps (and on Ctrl-C). `resume=True` continues
from the newest PPO checkpoint; a sequential-mode run of 2N steps and a run of N steps
plus a resumed N give identical metrics, and metrics.jsonl holds each step once. The
checkpoint's config fingerprint covers the mathematics only, not the plan (plan
mode, devices, meshes): a run may resume on another slice (`plan.num_devices`) or in
another mode, with a warning where that changes the staleness bound. With
`data.task='jsonl'` the user's files count by their content (`data/digests.py`): a
resume, or a warm start, from a checkpoint trained on a file that has changed since is
refused, naming the file.

Multi-process jobs (`jax.distributed` joined by `main.py`, see `distributed/`): every
process runs the job with the same config on a shared workdir (process 0's choice,
agreed through the coordination service). Process 0 alone writes files (datasets first,
then metrics, traces, samples, export); the others wait for the datasets and write
nothing. `sequential` and `per_stage` meshes span all processes' devices, every process
runs every program, and Orbax checkpoints are written by all processes together. In
`pipe` mode each stage lives on a group of processes (`system/pipe_processes.py`: one
process, or several whole processes of its own) and the training stage includes process
0 (its devices come last in the device order `plan.placement` cuts); the training
group alone holds and checkpoints the trainer state (host copies, written by process 0);
the warm start still runs on `config.mesh` over every process, after which each process
builds its own stages from host copies.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

from flax import nnx
import jax

from pipe_rlhf_jax import checkpoint as ckpt_lib
from pipe_rlhf_jax import distributed, envs
from pipe_rlhf_jax import metrics as metrics_lib
from pipe_rlhf_jax.concurrency.interrupts import SignalHandler
from pipe_rlhf_jax.concurrency.progress import ProgressDeadline
from pipe_rlhf_jax.config import ExperimentSettings
from pipe_rlhf_jax.data import digests
from pipe_rlhf_jax.distributed.faults import set_activity
from pipe_rlhf_jax.metrics import say
from pipe_rlhf_jax.models.transformer import init_model
from pipe_rlhf_jax.phases import heldout, ppo_loop, reporting, reward_norm, run_data, supervised
from pipe_rlhf_jax.phases import resume as resume_lib
from pipe_rlhf_jax.phases import warm_start as warm_lib
from pipe_rlhf_jax.phases.run_state import (
  BuiltSystem,
  Experiment,
  JobResult,
  ProcessRole,
  RunSetup,
)
from pipe_rlhf_jax.ppo.registry import REWARD_FUNCTIONS
from pipe_rlhf_jax.stages.episodes import EpisodeRunner
from pipe_rlhf_jax.system.steps import np_batch
from pipe_rlhf_jax.system.system import (
  Models,
  PPOSystem,
  build_layouts,
  check_fits,
  graphdef_of,
  ptx_rows_for,
  with_backbone,
)
from pipe_rlhf_jax.workdir import WorkdirLock

log = logging.getLogger(__name__)


def default_workdir(settings: ExperimentSettings) -> str:
  return os.path.join("runs", f"{settings.name}-{time.strftime('%Y%m%d-%H%M%S')}")


def select_devices(settings: ExperimentSettings, mode: str) -> list:
  """The first `plan.num_devices` of `jax.devices()` (0 = all of them), for a plan of
  mode `mode`.

  In `pipe` mode across processes, process 0's devices are moved to the end, so that
  `plan.placement`'s last block, the training stage, is process 0's: the process that
  writes the run's files also holds the trainer state (and Orbax saves the state of a
  one-process group only from process 0).
  """
  devices = jax.devices()
  if mode == "pipe" and jax.process_count() > 1:
    devices = ([d for d in devices if d.process_index != 0] +
               [d for d in devices if d.process_index == 0])
  n = settings.choice.num_devices
  if n and n != len(devices) and jax.process_count() > 1:
    raise ValueError(f"plan.num_devices={n} in a job of {jax.process_count()} "
                     f"processes: every process must hold devices of the meshes; use 0 "
                     f"(all {len(devices)} devices), or start fewer processes.")
  if n > len(devices):
    raise ValueError(f"plan.num_devices={n} but only {len(devices)} devices exist; use "
                     f"at most {len(devices)} (0 = all).")
  return devices[:n] if n else devices


def set_up(experiment: Experiment, workdir: str | None, resume: bool) -> RunSetup:
  """Checks everything that can be checked cheaply, before data are built.

  Chooses the devices for the experiment's plan, refuses to overwrite a run unless
  resuming, builds the stage layouts and checks the models and the SFT term's rows fit
  them (on abstract parameters), and reads where a resume starts, refusing a checkpoint
  whose mathematics or data differ. (The config was validated and the plan chosen when
  the experiment was built: `train.experiment_of`.)
  """
  settings = experiment.settings
  # The planner may have chosen another mode than the config's, and the device order
  # depends on it.
  devices = select_devices(settings, experiment.plan.mode)
  # Every process must use process 0's workdir (a default one is named by the clock).
  workdir = distributed.agree("workdir",
                              workdir or settings.workdir or default_workdir(settings))
  os.makedirs(workdir, exist_ok=True)
  # Before anything is written there, and released by `RunSetup.close` (or the kernel,
  # however this process ends).
  lock = WorkdirLock(workdir) if distributed.is_primary() else None
  try:
    return _set_up(experiment, workdir, resume, devices, lock)
  except BaseException:
    if lock is not None:
      lock.release()
    raise


def _set_up(experiment: Experiment, workdir: str, resume: bool, devices, lock) -> RunSetup:
  """`set_up` once the workdir is agreed and locked."""
  settings, plan = experiment.settings, experiment.plan
  tokenizer = run_data.run_tokenizer(settings.model)
  layouts = build_layouts(plan, devices)
  role = ProcessRole.of(plan, layouts, jax.process_index(), jax.process_count(),
                        jax.local_device_count())
  checkpointer = resume_lib.open_checkpoints(settings.checkpoint, workdir, role, resume)
  warm_layout = check_fits_before_compiling(experiment, layouts, devices)
  warm_source = warm_lib.resolve_source(settings, workdir)
  # What changes the mathematics; the plan (plan, meshes) is compared separately.
  # data.task='jsonl' files count by their content: one edited in place is other data.
  data_files = digests.file_digests(settings.data_files())
  fingerprint = ckpt_lib.config_fingerprint(digests.with_content(settings.to_dict(),
                                                                 data_files))
  start = resume_lib.resume_start(settings, checkpointer, fingerprint, data_files,
                       ppo_loop.plan_of(plan, devices)) if resume else 0
  deadline = ProgressDeadline(plan.progress_timeout_s, experiment.planned.predicted_step_s)
  return RunSetup(experiment, workdir, devices, tokenizer, layouts, checkpointer,
                  fingerprint, start, warm_layout, warm_source, role=role, lock=lock,
                  deadline=deadline, data_files=data_files,
                  episodes=episode_runner(settings, tokenizer))


def episode_runner(settings: ExperimentSettings, tokenizer) -> EpisodeRunner | None:
  """The runner of the experiment's multi-turn episodes (`env`), or None without an
  environment. Built at set-up: a chat template that does not render conversations turn
  by turn as it renders them whole is refused here, before anything trains."""
  if not settings.env.enabled:
    return None
  sampling = ppo_sampling(settings, tokenizer)
  return EpisodeRunner(envs.make_environment(settings.env.name), settings.env,
                       envs.renderer_for(tokenizer), tokenizer, settings.data.completion_len,
                       sampling.eos_id, sampling.pad_id)


def check_fits_before_compiling(experiment: Experiment, layouts: dict[str, Any], devices):
  """Checks, on abstract parameters, that the models fit the stage layouts and the
  warm-start mesh, and the SFT term's rows the training stage; returns the warm-start
  phases' layout."""
  settings, ppo, cfgs = experiment.settings, experiment.ppo, experiment.models
  abstract = {name: nnx.state(nnx.eval_shape(lambda c=cfgs[name]: init_model(c)))
              for name in ("actor", "critic") if name == "actor" or ppo.needs_critic}
  check_fits(layouts, abstract["actor"], abstract.get("critic"))
  ptx_rows_for(ppo, layouts["train"])
  warm_layout = supervised.warm_start_layout(
      settings.warm_start.mesh, devices,
      {"sft.batch_size": settings.sft.batch_size,
       **({"reward_model.batch_size": settings.reward_model.batch_size}
          if settings.reward.uses_model else {})})
  warm_layout.check_params(abstract["actor"], "warm_start.mesh")
  return warm_layout


def sampling_params(setup: RunSetup, system: PPOSystem):
  """The actor to show samples from: in the generation layout, or, in pipe mode across
  processes, where the trainer holds it (generation is another process's)."""
  return system.trained_actor() if setup.role.across else system.actor_for_generation()[0]


def open_metrics(setup: RunSetup) -> metrics_lib.MetricsWriter:
  """The metrics writer, after removing the rows this run is about to write again.

  A run that resumes at PPO step S (after a crash, or Ctrl-C) re-trains steps >= S, so
  their rows from before (phases "ppo" and "heldout") are dropped and the log holds each
  step once; the "data" row is written by every run, and the warm-start phases' rows
  again when their checkpoint is missing. TensorBoard event files cannot be rewritten,
  and TensorBoard does not keep only the newest value of a step: it keeps every event
  it reads, so the re-trained steps are plotted twice. (It drops events only after a
  SessionLog.START event, which tensorboardX writes for `purge_step`; but that drops
  every tag of the run directory at steps >= the purge step, SFT and reward-model curves
  included, since all phases share one directory
  and start at step 0.) metrics.jsonl is the record to trust after a resume.
  """
  # Trained here before (restored now) or restored from `warm_start.checkpoint`: either
  # way this run writes no warm-start rows, so the ones from before stay.
  warm_restored = setup.warm_source is not None

  def rewritten(record) -> bool:
    phase = record.get("phase")
    return ((phase in ("ppo", "heldout") and record.get("step", 0) >= setup.start)
            or phase in ("data", "plan")
            or (phase in warm_lib.PHASES and not warm_restored))

  if not setup.role.writes:
    return metrics_lib.SecondaryWriter(setup.workdir)
  dropped = metrics_lib.drop_metrics(setup.workdir, rewritten)
  if dropped:
    say(f"metrics.jsonl: dropped {dropped} rows of steps this run writes again "
        f"(PPO steps >= {setup.start})")
  log_settings = setup.experiment.settings.log
  return metrics_lib.MetricsWriter(setup.workdir, use_tensorboard=log_settings.tensorboard,
                                   use_wandb=log_settings.wandb,
                                   wandb_project=log_settings.wandb_project,
                                   config=setup.experiment.record.to_dict())


def ppo_sampling(settings: ExperimentSettings, tokenizer):
  """PPO's sampling distribution: completions of `data.completion_len` tokens at
  `ppo.temperature` / `top_k` / `top_p` (`SamplingSettings`)."""
  return settings.sampling.sampling_params(settings.data.completion_len, tokenizer)


def reward_statistics(settings: ExperimentSettings, setup: "RunSetup", warm: dict[str, Any],
                      data: dict[str, Any]) -> reward_norm.ScoreStatistics | None:
  """The reward model's score statistics under the warm-start policy, when
  `reward.normalize_samples_per_prompt` > 0 and the reward is a model; else None."""
  k = settings.reward.normalize_samples_per_prompt
  if not (k and settings.reward.uses_model):
    return None
  set_activity("measuring the reward model's scale")
  stats = reward_norm.score_statistics(
      graphdef_of(setup.cfgs["actor"]), warm["actor"], graphdef_of(setup.cfgs["reward"]),
      warm["reward"], np_batch(next(iter(data["prompts_norm"]))),
      ppo_sampling(settings, setup.tokenizer), samples_per_prompt=k, seed=settings.seed)
  say(f"reward model under the warm-start policy: score mean {stats.mean:.4g}, std "
      f"{stats.std:.4g} over {stats.samples} answers; PPO's reward is (score - mean) / std")
  return stats


def build_system(experiment: Experiment, warm: dict[str, Any], tokenizer, devices,
                 reward_stats: reward_norm.ScoreStatistics | None = None,
                 demos=None, episodes: EpisodeRunner | None = None) -> BuiltSystem:
  """Models, sampling settings, reward functions and the `PPOSystem` on `devices`.

  The one place that constructs the system from the experiment and its plan (the
  critic starts from the reward model's or the SFT policy's backbone, per
  `ppo.critic_init`). Only the models the algorithm uses are built: no critic for a
  critic-free estimator, no reference when `ppo.kl_coef == 0`. `demos` (the SFT
  `DemoLoader`) gives the pool of PPO's SFT term when `ppo.ptx_coef > 0`: the SFT data,
  every record once. `episodes` runs multi-turn episodes (`episode_runner`), whose
  environment gives the reward.
  """
  settings, plan, cfgs, ppo = (experiment.settings, experiment.plan,
                                  experiment.models, experiment.ppo)
  if reward_stats is not None:
    ppo = dataclasses.replace(ppo, reward_shift=reward_stats.mean,
                              reward_scale=reward_stats.std)
  actor_gd = graphdef_of(cfgs["actor"])
  critic_gd = critic = None
  if ppo.needs_critic:
    critic_gd = graphdef_of(cfgs["critic"])
    # Validation refuses critic_init="reward_model" with a rule reward (no reward model).
    critic_source = (warm["reward"] if settings.critic_init == "reward_model"
                     else warm["actor"])
    critic = with_backbone(cfgs["critic"], critic_source, settings.seed + 2)
  use_rm = settings.reward.uses_model
  reward_gd = graphdef_of(cfgs["reward"]) if use_rm else None
  models = Models(actor_graphdef=actor_gd, critic_graphdef=critic_gd, reward_graphdef=reward_gd,
                  actor=warm["actor"],
                  reference=warm["actor"] if ppo.needs_reference else None, critic=critic,
                  reward=warm["reward"] if use_rm else None)
  # LoRA: the warm start trained whole models; PPO trains adapters added to them here.
  models = models.with_adapters(settings.lora, settings.seed + 3)
  sampling = ppo_sampling(settings, tokenizer)
  decode = lambda ids: tokenizer.decode(ids)
  reward = settings.reward
  reward_fn = (None if use_rm or episodes is not None
               else REWARD_FUNCTIONS.get(reward.fn, field="reward.fn"))
  eval_fn = (REWARD_FUNCTIONS.get(reward.eval_fn, field="reward.eval_fn")
             if reward.eval_fn else None)
  # Without demos, PPOSystem's check names what the SFT term lacks.
  ptx_demos = demos.as_arrays() if ppo.ptx_coef and demos is not None else None
  system = PPOSystem(models, ppo=ppo,
                     sampling=sampling, plan=plan,
                     reward_fn=reward_fn, decode=decode, eval_fn=eval_fn, devices=devices,
                     ptx_demos=ptx_demos, episodes=episodes)
  return BuiltSystem(system, sampling, models.actor_graphdef, reward_stats)


def run(experiment: Experiment, workdir: str | None = None, *, resume: bool = False,
        stop_after: int | None = None, progress: bool = True) -> JobResult:
  """`train.train` on a built experiment (its arguments and result are documented
  there): the job under its signal handlers."""
  # SIGINT / SIGTERM: at once outside PPO's loop, at its next step boundary inside.
  with SignalHandler() as signals:
    return _run(experiment, workdir, resume, stop_after, progress, signals)


def _run(experiment: Experiment, workdir, resume, stop_after, progress, signals) -> JobResult:
  """`run` under its signal handlers."""
  start_time = time.perf_counter()
  settings = experiment.settings
  setup = set_up(experiment, workdir, resume)
  writer = open_metrics(setup)
  try:
    build_stats, data = run_data.build_data(setup)
    # Malformed-record decisions of every data loader, counted once up front.
    writer.write(0, {**build_stats, **{f"{name}/{key}": float(value)
                                       for name, loader in data.items() if loader is not None
                                       for key, value in loader.stats().items()}}, phase="data")
    set_activity("warm start (SFT, reward model)")
    warm = warm_lib.fit_or_restore(settings, setup.workdir, setup.warm_source, data,
                                  setup.cfgs, writer, setup.warm_layout, progress,
                                  setup.tokenizer)
    warm_devices = set(setup.warm_layout.mesh.devices.flat)
    if setup.role.across or (distributed.process_count() > 1
                        and warm_devices != set(setup.devices)):
      # jax moves arrays across processes only between meshes of the same devices: a
      # stage in one process (pipe mode across processes) or a warm-start mesh on some
      # of the devices hands over host copies instead (SPMD: every process fetches).
      warm = {k: distributed.fetch(v) if k in ("actor", "reward") else v
              for k, v in warm.items()}
    built = build_system(experiment, warm, setup.tokenizer, setup.devices,
                         reward_statistics(settings, setup, warm, data), data["demos"],
                         setup.episodes)
    for layout in built.system.layouts.values():
      say(f"stage {layout}")
    ppo_loop.restore_ppo(setup, built.system, data["prompts"])
    # Written only once the config is known to match any checkpoint it resumes.
    if setup.role.writes:
      with open(os.path.join(setup.workdir, "config.json"), "w", encoding="utf-8") as f:
        f.write(experiment.record.to_json_best_effort(indent=2))

    eval_batch = np_batch(next(iter(data["prompts_eval"])))
    rules = heldout.rule_rewards_to_report(settings)

    samples_per_prompt = (settings.log.eval_samples_per_prompt
                          if rules or setup.episodes is not None else 0)

    def evaluate(step: int) -> dict[str, heldout.HeldoutEval]:
      """The held-out answers at `step`: "greedy" (also the samples shown), and
      "sampled" with `log.eval_samples_per_prompt` > 0."""
      if not setup.role.trains:  # pipe mode across processes: the trainer's process evaluates
        return {}
      params = sampling_params(setup, built.system)
      evals = {"greedy": heldout.heldout_eval(built.actor_graphdef, params, eval_batch,
                                              setup.tokenizer, built.sampling, rules,
                                              settings.log.samples, episodes=setup.episodes)}
      if samples_per_prompt:
        evals["sampled"] = heldout.heldout_eval(
            built.actor_graphdef, params, eval_batch, setup.tokenizer, built.sampling, rules,
            0, samples_per_prompt=samples_per_prompt, episodes=setup.episodes)
      row = {f"heldout{'' if name == 'greedy' else '_' + name}/{rule}": value
             for name, result in evals.items() for rule, value in result.scores.items()}
      if row:
        writer.write(step, row, phase="heldout")
      return evals

    before = evaluate(setup.start)
    end = settings.ppo.steps if stop_after is None else min(stop_after, settings.ppo.steps)
    set_activity(f"PPO step {setup.start}")
    tracer = ppo_loop.PPOLoop(setup, built.system, data["prompts"], writer, end, progress,
                              signals).run()
    return reporting.report(setup, built, warm, tracer, writer, before, evaluate(end),
                            start_time)
  finally:
    writer.close()
    setup.close()


def prepare_warm_start(experiment: Experiment, workdir: str | None = None, *,
                       progress: bool = True) -> dict[str, Any]:
  """`train.prepare_warm_start` on a built experiment (documented there)."""
  with SignalHandler():  # a signal stops it at once (Interrupted); nothing is half-saved
    return _prepare_warm_start(experiment, workdir, progress)


def _prepare_warm_start(experiment: Experiment, workdir, progress) -> dict[str, Any]:
  settings = experiment.settings
  if settings.warm_start.checkpoint:
    raise ValueError("prepare_warm_start writes a warm start: leave warm_start.checkpoint "
                     "empty (it names one to restore).")
  setup = set_up(experiment, workdir, resume=False)
  writer = open_metrics(setup)
  try:
    build_stats, data = run_data.build_data(setup)
    writer.write(0, build_stats, phase="data")
    warm = warm_lib.fit_or_restore(settings, setup.workdir, setup.warm_source, data,
                                  setup.cfgs, writer, setup.warm_layout, progress,
                                  setup.tokenizer)
  finally:
    writer.close()
    setup.close()
  return {"workdir": setup.workdir, "checkpoint": os.path.join(setup.workdir, "warmstart"),
          "rm_eval": warm["rm_eval"]}
