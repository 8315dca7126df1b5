"""The CPU-backend flags the entry points set before jax starts (`host_devices`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipe_rlhf_jax import host_devices
from tests.helpers.xla_env import COMPILE_FLAGS, child_env

SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler"


@pytest.fixture
def env(monkeypatch):
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  return monkeypatch


def test_flags_are_added_once_beside_the_callers(env):
  env.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  assert host_devices.use_virtual_cpu_devices(4)
  assert host_devices.use_memory_lean_scheduler()
  assert not host_devices.use_memory_lean_scheduler()
  assert not host_devices.use_virtual_cpu_devices(8)
  assert os.environ["XLA_FLAGS"].split() == [
      "--xla_backend_optimization_level=0", "--xla_force_host_platform_device_count=4",
      f"{SCHEDULER}=false"]


def test_a_callers_choice_is_kept(env):
  env.setenv("XLA_FLAGS", f"{SCHEDULER}=true")
  assert not host_devices.use_memory_lean_scheduler()
  assert os.environ["XLA_FLAGS"] == f"{SCHEDULER}=true"
  env.setenv("JAX_PLATFORMS", "tpu")
  assert not host_devices.use_virtual_cpu_devices()


# What the flag is for: a backward pass compiled under it keeps fewer temporaries live.
_PROBE = """
import jax, jax.numpy as jnp
def grads(ws, x):
  def loss(ws):
    h = x
    for w in ws:
      h = jax.nn.silu(h @ w)
    return jnp.sum(h)
  return jax.grad(loss)(ws)
ws = [jax.ShapeDtypeStruct((512, 512), jnp.float32)] * 8
x = jax.ShapeDtypeStruct((1024, 512), jnp.float32)
print(jax.jit(grads).lower(ws, x).compile().memory_analysis().temp_size_in_bytes)
"""


def _temp_bytes(extra_flags: str, before: str = "") -> int:
  """The probe's temporary bytes in a fresh process under `extra_flags` (beside the tests'
  compile flags, without their scheduler choice), `before` run ahead of it."""
  env = child_env()
  env["XLA_FLAGS"] = f"{COMPILE_FLAGS} {extra_flags}".strip()
  out = subprocess.run([sys.executable, "-c", before + _PROBE], env=env,
                       capture_output=True, text=True, timeout=120, check=True)
  return int(out.stdout.split()[-1])


def test_importing_the_library_chooses_the_lean_scheduler_unless_jax_has_started():
  # One test, so that the two reference processes run once: the lean scheduler keeps fewer
  # temporaries live (what the choice is for, and what tells the cases below apart) ...
  lean, default = _temp_bytes(f"{SCHEDULER}=false"), _temp_bytes("")
  assert lean < default
  # ... a library user who imports the API first compiles as the entry points do ...
  assert _temp_bytes("", before="import pipe_rlhf_jax.system\n") == lean
  # ... and XLA_FLAGS that name the scheduler keep it.
  assert _temp_bytes(f"{SCHEDULER}=true", before="import pipe_rlhf_jax.system\n") == default
  # After jax has started, the flag could no longer take effect: it is left unset.
  probe = ("import os, jax\njax.devices()\nimport pipe_rlhf_jax.system\n"
           "print(os.environ.get('XLA_FLAGS'))\n")
  assert _temp_bytes("", before=probe) == default


def test_the_default_is_left_alone_once_jax_has_started(env, monkeypatch):
  env.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  monkeypatch.setattr(host_devices, "backends_started", lambda: True)
  assert not host_devices.use_memory_lean_scheduler_by_default()
  assert os.environ["XLA_FLAGS"] == "--xla_backend_optimization_level=0"
  monkeypatch.setattr(host_devices, "backends_started", lambda: False)
  assert host_devices.use_memory_lean_scheduler_by_default()
  assert os.environ["XLA_FLAGS"].endswith(f"{SCHEDULER}=false")
