"""Results pages: what an experiment measured, with where and how, written by the script.

Owns `machine_limits` (the matmul peak, f32 unless asked for another dtype, and the
memory bandwidth of this machine, measured in the calling process, so a page's rates are
read against the machine that produced them), `provenance` (the block every results page
starts with: the exact command, the git commit, the date, the versions, the CPU model and
cores, the devices and those two limits), `write_page` (a page under docs/results/,
replaced whole by a newer run; the git log keeps the older ones), `add_page_flag` (the
one `--page` flag every script that writes a page takes) and `record_row` (a measured row
appended to the script's raw outputs as it is measured, so a stopped run keeps its rows).

Usage, from an experiment script:

  from experiments import results
  results.add_page_flag(parser, "modes")
  args = parser.parse_args()
  limits = results.machine_limits()
  ...
  if args.page:
    results.write_page(args.page, "Runtime modes side by side", body_markdown, limits)
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "docs", "results")


def best_of(fn, repeats: int = 5) -> float:
  """Seconds of the fastest of `repeats` calls of `fn`, after one warm-up (compile) call."""
  fn()  # compile
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return min(times)


def machine_limits(n: int = 2048, stream_mib: int = 256, dtype: str = "float32"
                   ) -> dict[str, Any]:
  """This process's matmul peak (GFLOP/s) and memory bandwidth (GB/s), on its first
  device: a jitted n x n matmul in `dtype`, and the planner calibration's read probe
  over `stream_mib` MiB (`planner.calibrate.read_bandwidth`: the faster of a sum and a
  matrix-vector product), best of 5 each.

  A dtype other than float32 is named under "matmul_dtype" (the provenance block says
  which peak it is); float32 rows carry the two numbers alone.
  """
  import jax
  import jax.numpy as jnp

  from pipe_rlhf_jax.planner.calibrate import read_bandwidth
  device = jax.devices()[0]
  a = jax.device_put(jnp.ones((n, n), jnp.dtype(dtype)), device)
  matmul = jax.jit(lambda a: a @ a)
  t = best_of(lambda: matmul(a).block_until_ready())
  read_bytes, read_s = read_bandwidth(
      device, stream_mib, lambda fn, *args: best_of(lambda: jax.block_until_ready(fn(*args))))
  limits: dict[str, Any] = {"matmul_gflops": 2 * n**3 / t / 1e9,
                            "mem_gbps": read_bytes / read_s / 1e9}
  if jnp.dtype(dtype) != jnp.float32:
    limits["matmul_dtype"] = jnp.dtype(dtype).name
  return limits


SHORT_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def cpu_flags() -> str:
  """The widest x86 vector extension of this CPU (it sets f32 matmul speed by 2-4x)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      text = f.read()
  except OSError:
    return "unknown"
  for flag in ("avx512f", "avx2", "avx"):
    if f" {flag} " in text or f" {flag}\n" in text:
      return flag.upper()
  return "none of AVX/AVX2/AVX-512"


@functools.lru_cache(maxsize=1)
def git_commit() -> str:
  """The commit of the code that runs, read once, when a script first asks (scripts ask
  at start, `provenance` again at the end: edits made while a long run measures are not
  the code it measured)."""
  try:
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=12", "HEAD"],
                            capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--",
                            "pipe_rlhf_jax", "experiments", "configs"],
                           capture_output=True, text=True, check=True).stdout.strip()
    return commit + (" (with uncommitted changes)" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown (not a git checkout)"


def command_line() -> str:
  """The command that is running, as a user would type it from the repository root:
  `python -m experiments.NAME ARGS` for a module run with `-m` (`sys.argv[0]` is then its
  file's full path, so the module's name is read from `__main__`'s spec), otherwise
  `python PATH ARGS`."""
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  if spec is not None and spec.name.startswith("experiments."):
    head = ["-m", spec.name]
  else:
    head = [os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)]
  return "python " + " ".join(shlex.quote(a) for a in [*head, *sys.argv[1:]])


def provenance(limits: dict[str, Any] | None, command: str | None = None,
               extra: dict[str, Any] | None = None) -> str:
  """The provenance block of a results page (markdown)."""
  import flax
  import jax
  import jaxlib
  devices = jax.devices()
  rows = [
      ("command", f"`{command or command_line()}`"),
      ("commit", git_commit()),
      ("date", datetime.datetime.now().strftime("%Y-%m-%d %H:%M")),
      ("versions", f"python {platform.python_version()}, jax {jax.__version__}, jaxlib "
                   f"{jaxlib.__version__}, flax {flax.__version__}"),
      ("CPU", f"{cpu_model()}, {os.cpu_count()} cores, {cpu_flags()}"),
      ("devices", f"{len(devices)} x {devices[0].device_kind} ({jax.default_backend()})"),
      # What else ran: timings taken beside other work on a few cores are slower and
      # noisier than the same run alone.
      ("load average at writing", "{:.1f} / {:.1f} / {:.1f} (1 / 5 / 15 min)".format(
          *os.getloadavg())),
  ]
  if limits:
    dtype = limits.get("matmul_dtype", "float32")
    rows.append(("measured in this run", f"{SHORT_DTYPES.get(dtype, dtype)} matmul peak "
                                         f"{limits['matmul_gflops']:.0f} "
                                         f"GFLOP/s, memory bandwidth "
                                         f"{limits['mem_gbps']:.1f} GB/s (one device)"))
  for key, value in (extra or {}).items():
    rows.append((key, str(value)))
  return "\n".join(["| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]])


def add_page_flag(parser, default_name: str, shown: str | None = None) -> None:
  """Gives an argparse `parser` the `--page [NAME]` flag: without it no page is written,
  `--page` alone writes docs/results/<default_name>.md, `--page NAME` writes
  docs/results/NAME.md (and `--page ''` none). `args.page` is then the page's name, or
  None (or '') for no page. `shown` names the default in the help instead, for a script
  that writes one of several pages and resolves `default_name` (then a placeholder) to
  its page after parsing."""
  parser.add_argument("--page", nargs="?", const=default_name, default=None, metavar="NAME",
                      help=f"write docs/results/NAME.md (alone: {shown or default_name}); "
                           "without it, no page")


def record_row(directory: str, name: str, row: dict[str, Any]) -> None:
  """Appends `row` as one JSON line to `<directory>/<name>.jsonl` and prints it."""
  with open(os.path.join(directory, f"{name}.jsonl"), "a", encoding="utf-8") as f:
    f.write(json.dumps(row) + "\n")
  print(json.dumps(row), flush=True)


def write_page(name: str, title: str, body: str, limits: dict[str, Any] | None,
               command: str | None = None, extra: dict[str, Any] | None = None,
               directory: str = RESULTS_DIR) -> str:
  """Writes docs/results/<name>.md: the title, the provenance block, then `body`.

  Returns the page's path. A newer run replaces the page.
  """
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, f"{name}.md")
  text = (f"# {title}\n\n*Written by `{command or command_line()}`; re-run it to "
          f"replace this page.*\n\n{provenance(limits, command, extra)}\n\n"
          f"{body.strip()}\n")
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)
  return path
