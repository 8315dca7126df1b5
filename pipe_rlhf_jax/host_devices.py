"""XLA's CPU-backend flags for the command-line tools, set before jax starts its backend.

Owns the two flags the entry points and the experiment scripts give XLA on a CPU host,
each left alone when the caller's `XLA_FLAGS` already choose it:

- `use_virtual_cpu_devices`: `--xla_force_host_platform_device_count`, so a CPU-only
  machine gets the same 8 devices everywhere (every mesh of the project: data, fsdp,
  tensor, pipe and disjoint stage blocks).
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
  `experiments/bench_real_shapes.py --shapes smollm2-135m` on 2 cores of an AMD EPYC.
  XLA reads the flag for the whole process: `jax.jit`'s per-program `compiler_options`
  did not change the buffer assignment.

Imports nothing: it must run before jax reads its flags, when its first backend starts.
"""

from __future__ import annotations

import os

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
