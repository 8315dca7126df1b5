"""Where a resumed run starts, and what it refuses to resume from.

Owns `open_checkpoints` (the PPO checkpoints of a workdir, refusing to overwrite a run
unless resuming), `resume_start` (the step after the newest checkpoint, refusing one
whose mathematics or `data.jsonl` files differ, naming the fields or the file) and
`compare_plans` (how the resumed plan differs, with its own warning when the staleness
bound, i.e. what is computed, changes). Split from job.py, which owns the phases' order.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pipe_rlhf_jax import checkpoint as ckpt_lib
from pipe_rlhf_jax.config import ExperimentSettings
from pipe_rlhf_jax.config.experiment import CheckpointSettings
from pipe_rlhf_jax.data import digests
from pipe_rlhf_jax.metrics import say
from pipe_rlhf_jax.phases.run_state import ProcessRole

log = logging.getLogger(__name__)


def open_checkpoints(checkpoint: CheckpointSettings, workdir: str, role: ProcessRole,
                     resume: bool) -> ckpt_lib.Checkpointer:
  """The PPO checkpoints of `workdir`, after removing what an interrupted write of an
  earlier run left (by the processes that write them); refuses a workdir that holds
  checkpoints unless resuming."""
  ppo_dir = os.path.join(workdir, "checkpoints")
  checkpointer = ckpt_lib.Checkpointer(ppo_dir, max_to_keep=checkpoint.keep,
                                       processes=role.checkpoint_group,
                                       cleanup=role.trains)
  if checkpointer.unfinished:
    say(f"{ppo_dir}: removed {len(checkpointer.unfinished)} unfinished checkpoint "
        f"write(s) of an earlier run ({', '.join(checkpointer.unfinished)})")
  latest = checkpointer.latest_step()
  if latest is not None and not resume:
    raise FileExistsError(
        f"{ppo_dir} already holds PPO checkpoints (latest step {latest}); pass --resume "
        f"to continue, or choose a new --workdir. Nothing was changed.")
  return checkpointer


def effective_staleness(plan: dict[str, Any]) -> int:
  """How far a rollout may lag the policy: only `pipe` mode generates ahead."""
  return plan["max_staleness"] if plan["mode"] == "pipe" else 0


def _current_names(node: Any) -> Any:
  """A saved plan under today's names: a mesh of a checkpoint written before the pipeline
  axis had its own name reads `pipe` as `pipeline` (the plan's mode keeps "pipe")."""
  if not isinstance(node, dict):
    return node
  renamed = {("pipeline" if k == "pipe" and "tensor" in node else k): _current_names(v)
             for k, v in node.items()}
  return renamed


def compare_plans(saved: dict[str, Any] | None, current: dict[str, Any]) -> None:
  """Logs how the resumed run's plan differs from the checkpoint's.

  Meshes, placement, device count and mode change only how the same mathematics is laid
  out (up to the order of floating-point reductions); the staleness bound changes which
  policy generates each rollout, i.e. what is computed: that gets its own warning.
  """
  if saved is None:
    log.warning("The checkpoint records no run plan (written by an older version); "
                "resuming under mode=%s on %d devices.", current["mode"],
                current["num_devices"])
    return
  saved = _current_names(saved)
  changed = sorted(k for k in current if saved.get(k) != current[k])
  if changed:
    log.warning("Resuming under a different plan (%s): %s.", ", ".join(changed),
                "; ".join(f"{k}: {saved.get(k)!r} -> {current[k]!r}" for k in changed))
  before, after = effective_staleness(saved), effective_staleness(current)
  if before != after:
    log.warning(
        "The resumed schedule changes what PPO computes: rollouts may now lag the policy "
        "by up to %d update(s) instead of %d (mode %s -> %s, plan.max_staleness %s -> "
        "%s). Metrics after the resume are not those of an uninterrupted run.", after,
        before, saved["mode"], current["mode"], saved["max_staleness"],
        current["max_staleness"])


def resume_start(settings: ExperimentSettings, checkpointer: ckpt_lib.Checkpointer,
                 fingerprint: str, data_files: dict[str, Any], plan: dict[str, Any]) -> int:
  """The first PPO step a resumed run trains: the step after the newest checkpoint (0
  when there is none). Refuses a checkpoint whose data or mathematics differ, and logs
  how its plan differs from `plan`."""
  latest = checkpointer.latest_step()
  if latest is None:
    return 0
  meta = checkpointer.read_metadata(latest)
  check_same_data(meta, data_files, checkpointer.step_dir(latest))
  if meta.get("config_fingerprint") != fingerprint:
    raise ckpt_lib.CheckpointError(
        f"checkpoint {checkpointer.step_dir(latest)}: metadata 'config_fingerprint' is "
        f"{meta.get('config_fingerprint')!r} but the current run expects "
        f"{fingerprint!r}: the config changes the mathematics of the run that wrote it"
        f"{_changed_fields(meta, settings, data_files)}. Resume with that run's config (see "
        "config.json in the workdir), or use a new workdir.")
  compare_plans(meta.get("plan"), plan)
  return int(meta["step"]) + 1


def _changed_fields(meta: dict[str, Any], settings: ExperimentSettings,
                    data_files: dict[str, Any]) -> str:
  """`; changed: field: old -> new, ...` from the fields stored with the checkpoint."""
  saved = meta.get("config")
  if not isinstance(saved, dict):
    return " (the checkpoint predates the record of its fields: compare config.json)"
  changes = ckpt_lib.config_changes(saved, ckpt_lib.fingerprinted_fields(
      digests.with_content(settings.to_dict(), data_files)))
  shown = "; ".join(changes[:12]) + ("; ..." if len(changes) > 12 else "")
  return f"; changed: {shown}" if changes else ""


def check_same_data(meta: dict[str, Any], data_files: dict[str, Any], step_dir) -> None:
  """Refuses to resume from a checkpoint trained on data.jsonl files that have changed."""
  changed = digests.changed_file(meta.get("data_files"), data_files)
  if changed:
    raise ckpt_lib.CheckpointError(
        f"checkpoint {step_dir} was trained on other data: {changed}. A resumed run would "
        "continue at the checkpoint's position in different records: restore the file, "
        "or use a new workdir.")
