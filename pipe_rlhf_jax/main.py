"""The main job: SFT -> reward model -> PPO on an experiment config, in one command.

Parses the flags, then runs `pipe_rlhf_jax.train.train(config, workdir)`, which writes
metrics, checkpoints, a trace and Gantt chart, samples, the exported policy and a summary
under the workdir.

  python -m pipe_rlhf_jax.main --config=configs/quickstart.py [--workdir=DIR] [--resume]
  python -m pipe_rlhf_jax.main --config=configs/quickstart.py --workdir=DIR --warm_start_only

`--warm_start_only` trains SFT and the reward model into DIR/warmstart and stops; runs in
any mode then start PPO from it with --config.warm_start.checkpoint=DIR/warmstart.

Signals: SIGINT (Ctrl-C) or SIGTERM (a preemption, a scheduler's stop) during PPO ends the
run at the end of the current step, with a checkpoint of that step, and exits 130 / 143
(128 + the signal); `--resume` continues from it, equal to the uninterrupted run. The
same signal again aborts at once (the newest checkpoint on disk stays). Before PPO (data,
warm start) and after it (evaluation, export) a signal stops at once: nothing finished
is lost there. A step that makes no progress within `plan.progress_timeout_s` ends the
job with status 124, naming the stage and process that held it up.

Multi-process (one process per host): the same command on every host with
`--coordinator_address=HOST0:PORT --num_processes=N --process_id=I` (or
`--cluster_detection=auto` on a TPU pod / SLURM allocation); `python -m
pipe_rlhf_jax.launch` starts such a job on one machine.

Set XLA_FLAGS before jax is imported to get virtual CPU devices; when the flag is absent
and the only platform is the CPU, this entry point asks for 8, so the embedded default
exercises every mesh on a laptop. It also gives XLA's CPU compiler its memory-minimising
scheduler unless XLA_FLAGS choose one (`host_devices.use_memory_lean_scheduler`: the
update's temporaries at real model shapes are 40% smaller and its steps faster).
"""

import sys

from pipe_rlhf_jax.host_devices import use_memory_lean_scheduler, use_virtual_cpu_devices

use_virtual_cpu_devices()
use_memory_lean_scheduler()

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/quickstart.py", "Experiment config (a get_config() module).",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (default runs/<name>-<time>).")
_RESUME = flags.DEFINE_bool("resume", False, "Continue from the newest checkpoint in --workdir.")
_WARM_START_ONLY = flags.DEFINE_bool(
    "warm_start_only", False, "Only train (or restore) the warm start into --workdir/warmstart.")
# Joining a multi-process job (see pipe_rlhf_jax/distributed/cluster.py).
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", "", "host:port of process 0's coordination service (empty: "
    "one process).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "This process's index, 0-based.")
_BIND = flags.DEFINE_string(
    "coordinator_bind_address", "", "Where process 0's coordinator listens (default: "
    "exactly --coordinator_address, never every interface).")
_LISTEN_HOST = flags.DEFINE_string(
    "listen_host", "", "Interface of this process's transfer servers (default: the one "
    "that reaches the coordinator).")
_DETECT = flags.DEFINE_string(
    "cluster_detection", "off", "'auto' (or a method) lets jax read the job's shape from "
    "a TPU pod / SLURM / Open MPI / Kubernetes environment.")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 0, "Devices per process on the CPU backend (0: the default).")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_s", 10, "A process silent this long is dead; every other "
    "process then aborts.")
_CACHE = flags.DEFINE_string(
    "compilation_cache_dir", "", "jax's persistent compilation cache: a restarted or "
    "resumed job loads its programs from here instead of compiling them again. In a "
    "multi-process job process 0 writes it and every process reads it: a folder all "
    "hosts see (shared storage, a GCS bucket). On the CPU backend only process 0 finds "
    "its programs (jax's keys differ per process there). Its files are executables the "
    "job runs: keep it writable only by the job's own account. Empty: off.")


def distributed_config():
  """The `DistributedConfig` the flags describe (checked, with errors naming the flag)."""
  from pipe_rlhf_jax.distributed import DistributedConfig
  return DistributedConfig(
      coordinator_address=_COORDINATOR.value, num_processes=_NUM_PROCESSES.value,
      process_id=_PROCESS_ID.value, coordinator_bind_address=_BIND.value,
      cluster_detection=_DETECT.value, listen_host=_LISTEN_HOST.value,
      cpu_devices=_CPU_DEVICES.value, heartbeat_timeout_s=_HEARTBEAT.value)


def main(argv):
  del argv
  # Library chatter (jax's probe for TPU plugins on a machine without one, TFDS writers,
  # Orbax) stays at WARNING; the run's own milestones are printed by `train`. Set before
  # anything touches a backend: jax logs its platform probe when devices are first listed.
  logging.set_verbosity(logging.WARNING)
  from pipe_rlhf_jax import distributed
  from pipe_rlhf_jax.distributed.faults import FaultWatch
  # Before anything touches a backend: jax enumerates devices once.
  distributed.initialize(distributed_config())
  if _CACHE.value:
    import jax
    jax.config.update("jax_compilation_cache_dir", _CACHE.value)
    # Every program, however quick to compile: a PPO step is dozens of sub-second
    # compilations (jax's default keeps only those over 1 s), and together they are most
    # of a restarted job's first step.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  watch = FaultWatch.start()
  from pipe_rlhf_jax.train import prepare_warm_start, train  # after flags: jax sees XLA_FLAGS
  if _WARM_START_ONLY.value and _RESUME.value:
    raise app.UsageError("--warm_start_only and --resume: choose one.")
  from pipe_rlhf_jax.concurrency.interrupts import Interrupted, Stalled, exit_status
  try:
    if _WARM_START_ONLY.value:
      result = prepare_warm_start(_CONFIG.value, _WORKDIR.value,
                                  progress=sys.stderr.isatty())
      message = (f"warm start in {result['checkpoint']}; start PPO from it with "
                 f"--config.warm_start.checkpoint={result['checkpoint']}")
    else:
      result = train(_CONFIG.value, _WORKDIR.value, resume=_RESUME.value,
                     progress=sys.stderr.isatty())
      message = result.summary
  except Interrupted as e:
    # A clean stop (SIGINT / SIGTERM) after the final checkpoint: 128 + the signal.
    print(f"[pipe_rlhf_jax] {e}", file=sys.stderr, flush=True)
    if watch is not None and not e.agreed:
      watch.fail(e, status=e.exit_status)  # stopped alone: the others must stop too
    if watch is not None:
      watch.finish()  # every process stops at this step: end the watch as a normal end does
    sys.exit(e.exit_status)
  except KeyboardInterrupt as e:  # a second signal: abort, no final checkpoint
    print(f"[pipe_rlhf_jax] {e or 'interrupted'}", file=sys.stderr, flush=True)
    if watch is not None:
      watch.fail(e, status=exit_status(2))
    sys.exit(exit_status(2))
  except Exception as e:  # pylint: disable=broad-except
    status = e.exit_status if isinstance(e, Stalled) else 1
    if watch is None:
      if status != 1:
        print(f"[pipe_rlhf_jax] {e}", file=sys.stderr, flush=True)
        sys.exit(status)
      raise
    watch.fail(e, status=status)  # tells every other process, then exits non-zero
  if watch is not None:
    watch.finish()
  if message:
    print(message)


def run() -> None:
  """The installed command (`pip install -e .`), the same as `python -m pipe_rlhf_jax.main`."""
  import __main__
  if not getattr(__main__, "__doc__", None):
    __main__.__doc__ = __doc__  # absl's --help prints the main module's docstring
  sys.exit(app.run(main))


if __name__ == "__main__":
  app.run(main)
