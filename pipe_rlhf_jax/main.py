"""Command-line entry point: parse flags, then `train(config, workdir)`.

  python -m pipe_rlhf_jax.main --config=configs/quickstart.py [--workdir=DIR] [--resume]
  python -m pipe_rlhf_jax.main --config=configs/quickstart.py --workdir=DIR --warm_start_only

`--warm_start_only` trains SFT and the reward model into DIR/warmstart and stops; runs in
any runtime mode then start PPO from it with --config.warm_start.checkpoint=DIR/warmstart.

Set XLA_FLAGS before jax is imported to get virtual CPU devices; when the flag is absent
and the only platform is the CPU, this entry point asks for 8, so the embedded default
exercises every mesh on a laptop.
"""

import os
import sys


def _default_cpu_devices() -> None:
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "") and \
      os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()


_default_cpu_devices()

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/quickstart.py", "Experiment config (a get_config() module).",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (default runs/<name>-<time>).")
_RESUME = flags.DEFINE_bool("resume", False, "Continue from the newest checkpoint in --workdir.")
_WARM_START_ONLY = flags.DEFINE_bool(
    "warm_start_only", False, "Only train (or restore) the warm start into --workdir/warmstart.")


def main(argv):
  del argv
  from pipe_rlhf_jax.train import prepare_warm_start, train  # after flags: jax sees XLA_FLAGS
  # Library chatter (TFDS writers, Orbax) stays at WARNING; the run's own milestones are
  # printed by `train`.
  logging.set_verbosity(logging.WARNING)
  if _WARM_START_ONLY.value:
    if _RESUME.value:
      raise app.UsageError("--warm_start_only and --resume: choose one.")
    result = prepare_warm_start(_CONFIG.value, _WORKDIR.value,
                                progress=sys.stderr.isatty())
    print(f"warm start in {result['checkpoint']}; start PPO from it with "
          f"--config.warm_start.checkpoint={result['checkpoint']}")
    return
  result = train(_CONFIG.value, _WORKDIR.value, resume=_RESUME.value,
                 progress=sys.stderr.isatty())
  print(result["summary"])


if __name__ == "__main__":
  app.run(main)
