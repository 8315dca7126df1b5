"""Test setup: 8 virtual CPU devices and the tests' compile flags
(`tests/helpers/xla_env.py`), set before jax is imported anywhere."""

import os

from tests.helpers.xla_env import xla_flags

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
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
import warnings  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _sigint_has_pythons_handler(request):
  """Every test starts with SIGINT on Python's default handler, as a program does.

  Tests press Ctrl-C with `_thread.interrupt_main()`, which does nothing unless SIGINT
  has a Python handler (and raises only in the main thread). In a full CI run two Ctrl-C
  tests of one xdist worker got no interrupt (each passes alone); with the default
  handler set for just those two, the next run passed them and failed a third Ctrl-C
  test the same way: an earlier test in a worker leaves another handler behind. Such a
  test now gets a warning naming it, and the default is put back.
  """
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  left = signal.getsignal(signal.SIGINT)
  if left is not signal.default_int_handler:
    warnings.warn(f"{request.node.nodeid} left SIGINT's handler as {left!r}")
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
  """Runs the multi-process tests and those marked `long` first, keeping the collected
  order within each group.

  They are the longest (tens of seconds to minutes each); `pytest -n 2` (with
  `--dist=worksteal`, pyproject.toml) hands out tests in collection order, so started
  last they would leave one worker running the tail while the other idles. Longest first
  balances the workers (the classic longest-processing-time-first schedule).
  """
  def group(item):
    if item.get_closest_marker("long"):
      return 0  # the single longest cases: a real model, a whole experiment
    return 1 if item.get_closest_marker("multihost") else 2
  items.sort(key=group)
