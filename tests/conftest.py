"""Test setup: 8 virtual CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must follow the XLA_FLAGS assignment)

jax.config.update("jax_default_matmul_precision", "highest")

# Many tests build the same small programs (every `train()` call re-jits its stages):
# a persistent compilation cache turns the repeats from seconds into milliseconds. The
# cache is private to this process and deleted at exit: a cache shared across runs or
# pytest-xdist workers was seen to hand a worker an entry that aborted XLA on load.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

_CACHE_DIR = tempfile.mkdtemp(prefix="pipe_rlhf_jax_xla_cache_")
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


import signal  # noqa: E402
import threading  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def ctrl_c_reaches_the_test():
  """For tests that press Ctrl-C with `_thread.interrupt_main()`: it raises
  KeyboardInterrupt only in the main thread and only while SIGINT has Python's default
  handler, else it does nothing and the test would wait for an interrupt that never
  comes. (A full CI run saw both Ctrl-C tests of one xdist worker get no interrupt while
  each passed alone.) The handler is set for the test and restored after."""
  assert threading.current_thread() is threading.main_thread(), (
      "interrupt_main() interrupts the main thread; this test must run in it")
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, previous)
