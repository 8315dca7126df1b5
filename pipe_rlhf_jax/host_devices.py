"""XLA's CPU-backend flags for the command-line tools, set before jax starts its backend.

Owns the two flags the entry points and the experiment scripts give XLA on a CPU host,
each left alone when the caller's `XLA_FLAGS` already choose it, and the library's default
of the second (`use_memory_lean_scheduler_by_default`, run when `pipe_rlhf_jax.system` is
imported):

- `use_virtual_cpu_devices`: `--xla_force_host_platform_device_count`, so a CPU-only
  machine gets the same 8 devices everywhere (every mesh of the project: data, fsdp,
  tensor, pipeline and disjoint stage blocks).
- `use_memory_lean_scheduler`: `--xla_cpu_enable_concurrency_optimized_scheduler=false`,
  XLA's memory-minimising instruction order instead of the one that keeps independent
  ops ready to run at once. On the CPU the wider order mostly keeps more temporaries live,
  and every call of a program allocates its temporaries afresh, its first writes faulting
  the pages in. At SmolLM2-135M's shape (batch 8, 64 + 64 tokens, f32, one device) the
  PPO update's temporary buffer was 5.25 GB with the default order and 3.08 GB with the
  lean one, inference's 870 MB against 102 MB, the prefill's 451 MB against 29 MB, the
  decode step's 432 MB either way (the compiled modules' buffer assignments,
  `--xla_dump_to`); the update took 13.3-15.4 s per step (mean 14.5 s) against
  9.5-11.5 s (mean 10.5 s), three runs each of two steps of
  `python -m experiments.bench_ppo_step --shapes smollm2-135m` on 2 cores of an AMD EPYC.
  XLA reads the flag for the whole process: `jax.jit`'s per-program `compiler_options`
  did not change the buffer assignment.

Imports nothing of jax: it must run before jax reads its flags, when its first backend
starts.
"""

from __future__ import annotations

import logging
import os
import sys

DEFAULT_COUNT = 8
_FLAG = "--xla_force_host_platform_device_count"
_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def _add_flag(flag: str) -> None:
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


def use_virtual_cpu_devices(count: int = DEFAULT_COUNT) -> bool:
  """Asks XLA for `count` CPU devices unless the caller chose a count or a non-CPU platform.

  Takes effect only when it runs before jax's first backend starts (importing jax does not
  start one; `jax.devices()` does). Returns whether it set the flag.
  """
  if (_FLAG.lstrip("-") in os.environ.get("XLA_FLAGS", "")
      or os.environ.get("JAX_PLATFORMS", "") not in ("", "cpu")):
    return False
  _add_flag(f"{_FLAG}={count}")
  return True


def use_memory_lean_scheduler() -> bool:
  """Asks XLA's CPU compiler for its memory-minimising scheduler unless the caller chose.

  Only the CPU compiler reads the flag, so it is harmless beside an accelerator. Takes
  effect only before jax's first backend starts. Returns whether it set the flag.
  """
  if _SCHEDULER_FLAG.lstrip("-") in os.environ.get("XLA_FLAGS", ""):
    return False
  _add_flag(f"{_SCHEDULER_FLAG}=false")
  return True


def backends_started() -> bool:
  """Whether jax has started a backend in this process (XLA has then read its flags)."""
  if "jax" not in sys.modules:
    return False
  try:
    from jax._src import xla_bridge
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):
    # A jax without the query: counted as started, so that no flag is set that might not
    # take effect (and would reach only the processes this one starts).
    return True


def use_memory_lean_scheduler_by_default() -> bool:
  """The library's default: `use_memory_lean_scheduler` while jax's backends have not
  started. A library user who imports `pipe_rlhf_jax.system` (or `PPOSystem`, `run`)
  before anything starts jax gets the scheduler the command-line entry points set;
  `XLA_FLAGS` that name the flag (`...=true` for XLA's own order) keep the caller's
  choice. Once a backend has started, XLA has read its flags for the whole process: the
  flag is then left unset (it could no longer take effect) and, on a CPU backend, a log
  line says how to get it. Returns whether it set the flag.
  """
  if backends_started():
    if _SCHEDULER_FLAG.lstrip("-") not in os.environ.get("XLA_FLAGS", ""):
      import jax
      if jax.default_backend() == "cpu":
        logging.getLogger(__name__).info(
            "jax started before pipe_rlhf_jax.system was imported: XLA's CPU compiler "
            "keeps its default instruction order. Import pipe_rlhf_jax.system (or call "
            "pipe_rlhf_jax.host_devices.use_memory_lean_scheduler()) before jax.devices() "
            "or the first computation for its memory-minimising one.")
    return False
  return use_memory_lean_scheduler()
