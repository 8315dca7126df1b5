"""Which programs on disjoint virtual CPU devices actually run at the same time.

`pipe` mode overlaps stages on disjoint devices; on this backend (8 virtual devices of
one host) the planner's simulator assumes that concurrent stages share the host's cores
(processor sharing). This measures what the system does instead: a long program is
started on devices 6-7 from a thread, and 20 ms later a short program on other devices
is timed, alone and meanwhile. If the short one's time jumps to about the long one's
remaining time, it waited for the long one to finish: the two did not overlap.

Cases (long / short):
  1-device / 1-device      a matmul loop / a matmul
  2-device / 1-device      a matmul loop with an all-gather per step / a matmul
  2-device / 4-device      the same / a matmul with an all-gather
  2-device / 4-device      the same / elementwise only (no collective)
  2-device / 4-device      elementwise only (no collective) / elementwise only

Writes experiments/out/cpu_concurrency/results.json and prints a table.

  python -m experiments.bench_cpu_concurrency
"""

from __future__ import annotations

import json
import os
import threading
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from pipe_rlhf_jax.host_devices import use_virtual_cpu_devices  # noqa: E402

use_virtual_cpu_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P
import numpy as np  # noqa: E402


def matmul_loop(x):
  """40 steps of x <- tanh(x x^T): with rows sharded, each step all-gathers x."""
  def step(c, _):
    return jnp.tanh(c @ c.T) * 0.5, None
  return jax.lax.scan(step, x, None, length=40)[0]


def elementwise_loop(x):
  """400 elementwise steps: no collective whatever the sharding."""
  def step(c, _):
    return jnp.tanh(c * 1.0001 + 0.1), None
  return jax.lax.scan(step, x, None, length=400)[0]


def program(fn, devices, shape, spec):
  """`fn` jitted on a 1-D mesh over `devices`, with its input placed there."""
  mesh = Mesh(np.array(devices), ("x",))
  sharding = NamedSharding(mesh, spec)
  f = jax.jit(fn, out_shardings=sharding)
  x = jax.device_put(jnp.full(shape, 0.01, jnp.float32), sharding)
  f(x).block_until_ready()  # compile
  return lambda: f(x).block_until_ready()


def timed(run) -> float:
  start = time.perf_counter()
  run()
  return time.perf_counter() - start


def overlap_case(name, long_run, short_run, repeats: int = 3) -> dict:
  long_alone = min(timed(long_run) for _ in range(repeats))
  short_alone = min(timed(short_run) for _ in range(repeats))
  during, long_total = [], []
  for _ in range(repeats):
    thread = threading.Thread(target=long_run)
    start = time.perf_counter()
    thread.start()
    time.sleep(0.02)
    during.append(timed(short_run))
    thread.join()
    long_total.append(time.perf_counter() - start)
  short_during = float(np.median(during))
  # Waited: the short program took most of what was left of the long one.
  waited = short_during > 0.5 * (float(np.median(long_total)) - 0.02)
  return {"case": name, "long_alone_s": long_alone, "short_alone_s": short_alone,
          "short_during_s": short_during, "long_with_short_s": float(np.median(long_total)),
          "short_waited_for_long": bool(waited)}


def main() -> None:
  devs = jax.devices()
  out_dir = os.path.join(_ROOT, "experiments", "out", "cpu_concurrency")
  os.makedirs(out_dir, exist_ok=True)
  long_1 = program(matmul_loop, devs[6:7], (768, 768), P())
  long_2 = program(matmul_loop, devs[6:8], (768, 768), P("x"))
  long_2_plain = program(elementwise_loop, devs[6:8], (2048, 2048), P("x"))
  short_1 = program(lambda x: jnp.tanh(x @ x.T), devs[2:3], (256, 256), P())
  short_4 = program(lambda x: jnp.tanh(x @ x.T), devs[2:6], (256, 256), P("x"))
  short_4_plain = program(lambda x: jnp.tanh(x) * 2, devs[2:6], (256, 256), P("x"))
  cases = [
      overlap_case("1-device matmul loop / 1-device matmul", long_1, short_1),
      overlap_case("2-device loop with all-gathers / 1-device matmul", long_2, short_1),
      overlap_case("2-device loop with all-gathers / 4-device matmul with all-gather",
                   long_2, short_4),
      overlap_case("2-device loop with all-gathers / 4-device elementwise", long_2,
                   short_4_plain),
      overlap_case("2-device elementwise loop / 4-device elementwise", long_2_plain,
                   short_4_plain),
  ]
  result = {"jax": jax.__version__, "backend": jax.default_backend(), "cases": cases}
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(result, f, indent=1)
  print(f"jax {jax.__version__}, {jax.default_backend()}, {len(devs)} devices")
  print("| long / short | long alone | short alone | short meanwhile | waited |")
  print("|---|---|---|---|---|")
  for c in cases:
    print(f"| {c['case']} | {c['long_alone_s'] * 1e3:.0f} ms | "
          f"{c['short_alone_s'] * 1e3:.1f} ms | {c['short_during_s'] * 1e3:.1f} ms | "
          f"{'yes' if c['short_waited_for_long'] else 'no'} |")


if __name__ == "__main__":
  main()
