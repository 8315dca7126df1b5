"""The main job with one fault injected where a test asks: the fault tests' program.

  PIPE_RLHF_JAX_FAULT=sigterm@train:2 python tests/distributed/fault_worker.py \\
      --config=configs/quickstart.py:tiny [main job flags]

Runs `pipe_rlhf_jax.main` with one fault at one moment of a PPO step. The fault comes from
the environment, so that every process of a launched job reads the same description:

  PIPE_RLHF_JAX_FAULT = "<kind>@<moment>:<call>[:<process>]"

kind: "sigint" / "sigterm" / "sigkill" (the process signals itself at that moment, as a
terminal, a scheduler or the OOM killer would), "raise" (an exception in the stage),
"hang" (a native call that never returns: a stuck reward server, a wedged device),
"hang_python" (a Python loop that never ends).
moment: "generate" (a rollout batch is being sampled), "infer" (its experience is being
computed), "train" (the update has been dispatched: its buffers are donated, its metrics
not yet fetched), "save" (a checkpoint write has started and runs in the background).
call: the fault fires at that moment's call number `call` (0-based; one call per PPO step
from the run's first step, a save only at checkpoint steps).
process: only on that process of a multi-process job (default: every process).

It prints `[fault_worker] injecting <kind> at <moment> call <n> t=<unix time>` first, so
a caller can time how long the job takes to stop. The rule `faulty_arith_exact_match`
(the arith task's rule) is registered too, for jobs that inject through the reward.
"""

import ctypes
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from pipe_rlhf_jax.data import rewards  # noqa: E402
from pipe_rlhf_jax.ppo.registry import REWARD_FUNCTIONS  # noqa: E402

_CALLS: dict[str, int] = {}


def _fault() -> tuple[str, str, int, int | None] | None:
  spec = os.environ.get("PIPE_RLHF_JAX_FAULT", "")
  if not spec:
    return None
  kind, _, where = spec.partition("@")
  moment, call, *process = where.split(":")
  return kind, moment, int(call), int(process[0]) if process else None


def inject(moment: str) -> None:
  """Fires the configured fault if this is its moment, call and process."""
  n = _CALLS.get(moment, 0)
  _CALLS[moment] = n + 1
  fault = _fault()
  if fault is None:
    return
  kind, at_moment, at_call, process = fault
  if moment != at_moment or n != at_call:
    return
  import jax
  if process is not None and process != jax.process_index():
    return
  print(f"[fault_worker] injecting {kind} at {moment} call {n} t={time.time():.3f}",
        flush=True)
  if kind in ("sigint", "sigterm", "sigkill"):
    os.kill(os.getpid(), {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM,
                          "sigkill": signal.SIGKILL}[kind])
  elif kind == "raise":
    raise RuntimeError(f"injected failure at {moment} call {n}")
  elif kind == "hang":
    ctypes.CDLL(None).sleep(3600)
  elif kind == "hang_python":
    while True:
      time.sleep(0.05)
  else:
    raise ValueError(f"PIPE_RLHF_JAX_FAULT kind {kind!r}; see tests/distributed/fault_worker.py")


def _patch() -> None:
  from pipe_rlhf_jax import checkpoint
  from pipe_rlhf_jax.stages.generate import GenerateStage
  from pipe_rlhf_jax.stages.infer import InferStage
  from pipe_rlhf_jax.stages.train import TrainStage

  def before(cls, name, moment):
    original = getattr(cls, name)

    def patched(self, *args, **kwargs):
      inject(moment)
      return original(self, *args, **kwargs)
    setattr(cls, name, patched)

  def after(cls, name, moment):
    original = getattr(cls, name)

    def patched(self, *args, **kwargs):
      out = original(self, *args, **kwargs)
      inject(moment)
      return out
    setattr(cls, name, patched)

  before(GenerateStage, "__call__", "generate")
  before(InferStage, "__call__", "infer")
  after(TrainStage, "update", "train")  # dispatched (donated), not yet fetched
  after(checkpoint.Checkpointer, "save", "save")  # the write runs in the background


@REWARD_FUNCTIONS.register("faulty_arith_exact_match")
def faulty_arith_exact_match(prompts, completions):
  inject("reward")
  return rewards.arith_exact_match(prompts, completions)


if __name__ == "__main__":
  from absl import app

  from pipe_rlhf_jax import main as main_module
  _patch()
  app.run(main_module.main)
