"""How the tests' processes compile: XLA's flags for pytest and for every child it starts.

Imports nothing of jax: `tests/conftest.py` reads it before jax starts its backend.

The tests' programs are tiny (models of a few thousand parameters, a few steps), so a
test's time is mostly XLA compiling them, not running them. The CPU backend's LLVM
optimisation level 0 compiles them faster and runs them correctly (the same results:
every equality and parity test holds at it), so the tests, and the jobs and scripts they
start, compile at it. The default tier took 9.1 min at the default level and 6.6 min at 0
(`python -m pytest -q -n 2` on 2 cores of an AMD EPYC, AVX-512). Runs outside the tests
(the main job, the benchmarks) keep XLA's default level.
"""

from __future__ import annotations

import os

COMPILE_FLAGS = "--xla_backend_optimization_level=0"
# XLA's own instruction order, named so that importing `pipe_rlhf_jax.system` keeps it
# (the library otherwise chooses the memory-lean one, `host_devices`): the memory model's
# comparisons with XLA (tests/planner/test_memory.py) were measured under it.
SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
DEVICE_FLAG = "--xla_force_host_platform_device_count"


def xla_flags(devices: int | None = None) -> str:
  """XLA_FLAGS of a test process: the tests' compile and scheduler flags, and `devices`
  virtual CPU devices (None: leave the count to the program, as the entry points and
  `launch --cpu_devices` choose their own)."""
  return f"{COMPILE_FLAGS} {SCHEDULER_FLAG}" + (f" {DEVICE_FLAG}={devices}" if devices
                                                else "")


def child_env(devices: int | None = None, **extra: str) -> dict[str, str]:
  """The environment of a process a test starts: the test's own, on the CPU, with
  `xla_flags(devices)` in place of the pytest process's device count, and `extra` set."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = xla_flags(devices)
  env["JAX_PLATFORMS"] = "cpu"
  env.update(extra)
  return env
