"""The planner inside the main job: `plan.choose = "auto"`, and the planner's veto.

Owns what `train.experiment_of` asks of the planner before anything is built or compiled:
  * which hardware profile describes the devices the run sees (`detect_hardware`; the
    config field `plan.hardware` overrides it) and which efficiencies price it (the
    calibration file `plan.calibration` when given, else the profile's analytic
    defaults);
  * `plan.choose = "auto"`: the best plan of the space for this experiment on these
    devices (`search.search`), returned typed (`PlannedRun.plan`): the run uses it as
    it is, and the config is only written with its fields for the record (`as_run`,
    config.json); the search keeps `plan.max_staleness` as the bound the user allows (an
    algorithmic choice: how far off-policy a rollout may be), trying 0..bound;
  * `plan.choose = "manual"` (the default, the hand-written plan): the planner's checks
    (the system's own, on abstract meshes, and the memory model) run on it, and a plan
    they reject fails here with their reason, before data are built or SFT compiles;
  * the predicted steady seconds per step of the plan that runs, and the measured one
    from the run's trace (`concurrency.tracing.steady_step_time`), for the summary and metrics.

It reads the experiment's typed settings (`config.ExperimentSettings`): the plan's
choice and inputs are `settings.choice` (`config.PlanChoice`: plan.choose, hardware,
calibration, response_fraction), the hand-written plan `settings.plan`.
"""

from __future__ import annotations

import dataclasses
import os

from pipe_rlhf_jax.config import STAGES, ExperimentSettings, Plan, PlannedRun
from pipe_rlhf_jax.models.config import TransformerConfig
from pipe_rlhf_jax.planner import cost, hardware, search, space
from pipe_rlhf_jax.stages.train import TrainSettings

# device_kind substrings (lower case) -> profile; the first match wins, so the more
# specific names come first ("tpu v5 lite" is a v5e, a bare "tpu v5" a v5p).
_KINDS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100-80gb"),
          ("tpu v5 lite", "tpu-v5e"), ("tpu v5e", "tpu-v5e"), ("tpu v5p", "tpu-v5p"),
          ("tpu v5", "tpu-v5p"), ("tpu v6", "tpu-v6e"), ("tpu v4", "tpu-v4"))


def _host_ram_bytes() -> float:
  return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def detect_hardware(devices, name: str = "") -> hardware.Hardware:
  """The profile of `devices` (or the profile `name`, from `plan.hardware`).

  On the CPU backend the `cpu` profile is sized to the local host: its RAM, shared by every
  virtual device the process has (`jax.device_count()`), not only the run's.
  """
  import jax
  if name:
    try:
      return hardware.get(name)
    except ValueError as e:
      raise ValueError(f"plan.hardware: {e}") from None
  platform = devices[0].platform
  if platform == "cpu":
    return dataclasses.replace(hardware.get("cpu"), hbm_bytes=_host_ram_bytes(),
                               devices_per_host=jax.local_device_count())
  kind = devices[0].device_kind.lower()
  for key, profile in _KINDS:
    if key in kind:
      return hardware.get(profile)
  raise ValueError(f"no hardware profile matches device_kind={devices[0].device_kind!r} "
                   f"({platform}); set plan.hardware to one of "
                   f"{sorted(hardware.PROFILES)} (the closest), or plan.choose='manual' "
                   "with plan.hardware naming a profile.")


def workload(settings: ExperimentSettings, actor: TransformerConfig, num_devices: int,
             devices_per_host: int) -> space.Workload:
  """What one PPO step of the experiment computes, on `num_devices` devices."""
  ppo = settings.ppo
  return space.Workload(
      actor=settings.lora.apply(actor), batch_size=ppo.batch_size,
      minibatch_size=ppo.minibatch_size,
      epochs=ppo.epochs, prompt_len=settings.data.prompt_len,
      gen_len=settings.data.completion_len, num_devices=num_devices,
      devices_per_host=min(devices_per_host, num_devices),
      reward_model=settings.reward.uses_model, critic_model=ppo.needs_critic,
      reference_model=ppo.needs_reference,
      proximal_pass=TrainSettings.from_settings(ppo, 1.0).proximal_pass, ptx_rows=ppo.ptx_rows,
      group_size=ppo.group_size, response_fraction=settings.choice.response_fraction)


def options_of(settings: ExperimentSettings) -> space.SpaceOptions:
  """The search's knobs from the settings: staleness 0..plan.max_staleness, and the
  execution fields (attention, logits chunk) of the hand-written training stage."""
  train = settings.plan.train
  return space.SpaceOptions(staleness=tuple(range(settings.plan.max_staleness + 1)),
                            attention=train.attention, logits_chunk=train.logits_chunk)


def machine_of(settings: ExperimentSettings, devices) -> cost.Machine:
  """The hardware profile and efficiencies that price a run on `devices`."""
  hw = detect_hardware(devices, settings.choice.hardware)
  path = settings.choice.calibration
  if path:
    if not os.path.isfile(path):
      raise ValueError(f"plan.calibration={path!r} is not a file; write one with "
                       "`python -m pipe_rlhf_jax.planner.calibrate --out FILE`, or set "
                       "plan.calibration='' to use the analytic efficiencies.")
    eff = cost.Efficiency.load(path)
    eff = dataclasses.replace(eff, source=f"calibration {path} ({eff.source})")
  else:
    eff = cost.Efficiency(source=f"analytic {hw.name} profile, assumed efficiencies "
                          "(no plan.calibration)")
  return cost.Machine(hw, eff)


def _planned(c: search.Candidate, chosen: bool, m: cost.Machine, seconds: float
             ) -> PlannedRun:
  return PlannedRun(plan=c.plan, chosen=chosen, predicted_step_s=c.step_time,
                    bottleneck=c.bottleneck,
                    memory_gib={k: v / hardware.GIB for k, v in c.memory.items()},
                    hardware=m.hw.name, efficiency=m.eff.source, search_s=seconds)


def runnable_across_processes(plan: Plan, processes: int,
                              devices_per_process: int) -> bool:
  """Whether the system can run `plan` in a job of `processes` processes.

  `pipe` mode there (`system/pipe_processes.py`) places each stage within one process
  (several stages may share it) or on whole processes of its own, with each process's
  devices a rectangular block of the stage's mesh (so it can receive its block of an
  array); the device order cuts at process boundaries. One process runs anything.
  """
  if processes == 1 or plan.mode != "pipe" or plan.placement is None:
    return True
  import numpy as np

  from pipe_rlhf_jax.distributed.transfer import is_rectangular
  from pipe_rlhf_jax.system.system import stage_mesh_shapes
  try:
    shapes = stage_mesh_shapes(plan, processes * devices_per_process)
  except ValueError:
    return False
  for shape, _, indices in shapes.values():
    owners = np.asarray(indices) // devices_per_process
    if owners[0] == owners[-1]:
      continue  # within one process
    if indices[0] % devices_per_process or len(indices) % devices_per_process:
      return False  # shares a process with another stage
    grid = owners.reshape(shape.axis_sizes())
    if not all(is_rectangular(grid == p) for p in np.unique(owners)):
      return False
  return True


def plan_run(settings: ExperimentSettings, actor: TransformerConfig, devices
             ) -> PlannedRun:
  """The plan the run uses for `plan.choose` on `devices`, and its prediction.

  "auto": the search's best plan. "manual": the config's own plan, after the planner's
  checks; raises ValueError with the planner's reason when the hand-written plan cannot
  run (the system's checks on abstract meshes, then the memory model on the detected
  hardware).
  """
  choice = settings.choice.choose
  if choice == "auto":
    custom = [s for s in STAGES if settings.plan.stage(s).rules]
    if custom:
      raise ValueError(f"plan.choose='auto' plans with each stage's default logical "
                       f"rules, but stages.{custom[0]}.rules is set; remove it, or use "
                       "plan.choose='manual'.")
  import jax  # (the backend exists by now: `devices` came from it)
  processes = jax.process_count()
  m = machine_of(settings, devices)
  # In a multi-process job a process is a host: placements align to its devices.
  per_host = len(devices) // processes if processes > 1 else m.hw.devices_per_host
  work = workload(settings, actor, len(devices), per_host)
  if choice == "manual":
    plan = settings.plan
    reason = space.plan_error(plan, work)
    if reason is None:
      c = search.price(plan, work, m, simulate=True)
      reason = c.rejected
    if reason is not None:
      raise ValueError(
          f"the hand-written plan {plan} cannot run {work.batch_size} rollouts of "
          f"{work.length} tokens on {len(devices)} {m.hw.name} devices: "
          f"{reason.rstrip('.')}. Change plan / mesh / stages (or ppo.minibatch_size), "
          "or let the planner choose: --config.plan.choose=auto.")
    return _planned(c, False, m, 0.0)
  best, rejected, stats = search.search(work, m, options_of(settings),
                                        k=1 if processes == 1 else 64)
  best = [c for c in best if runnable_across_processes(c.plan, processes, per_host)][:1]
  if not best:
    reasons = "; ".join(f"{c.plan}: {c.rejected}" for c in rejected[:3])
    raise ValueError(f"plan.choose='auto': no plan of the space fits {len(devices)} "
                     f"{m.hw.name} devices ({len(rejected)} rejected, e.g. {reasons}); "
                     "reduce ppo.minibatch_size or the model, or add devices.")
  # The search prices plans with the default timeouts; the run keeps the config's.
  chosen = dataclasses.replace(best[0].plan,
                               shutdown_timeout_s=settings.plan.shutdown_timeout_s,
                               progress_timeout_s=settings.plan.progress_timeout_s)
  return _planned(dataclasses.replace(best[0], plan=chosen), True, m, stats["seconds"])


def as_run(config, planned: PlannedRun):
  """The experiment as it runs: `config`, with the fields of the plan the planner chose
  written in (a copy; a hand-written plan is the config's own). For config.json and the
  metrics' record, so that the workdir says which plan ran."""
  if not planned.chosen:
    return config
  run = space.apply_overrides(config, space.to_overrides(planned.plan, config))
  if planned.plan.placement is None and "placement" in run.plan:
    run.plan.placement = None  # only pipe mode places stages on device blocks
  return run
