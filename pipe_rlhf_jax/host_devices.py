"""Virtual CPU devices for the command-line tools, set before jax starts its backend.

Owns `use_virtual_cpu_devices`: the one place that adds XLA's
`--xla_force_host_platform_device_count` flag, so the entry points and the experiment
scripts all give a CPU-only machine the same 8 devices (every mesh of the project: data,
fsdp, tensor, pipe and disjoint stage blocks) and all leave a caller's choice alone.
Imports nothing: it must run before jax reads its flags, when its first backend starts.
"""

from __future__ import annotations

import os

DEFAULT_COUNT = 8
_FLAG = "--xla_force_host_platform_device_count"


def use_virtual_cpu_devices(count: int = DEFAULT_COUNT) -> bool:
  """Asks XLA for `count` CPU devices unless the caller chose a count or a non-CPU platform.

  Takes effect only when it runs before jax's first backend starts (importing jax does not
  start one; `jax.devices()` does). Returns whether it set the flag.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if _FLAG.lstrip("-") in flags or os.environ.get("JAX_PLATFORMS", "") not in ("", "cpu"):
    return False
  os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={count}".strip()
  return True
