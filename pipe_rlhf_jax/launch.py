"""Local launcher of a multi-process job: N processes of the main job on this machine.

  python -m pipe_rlhf_jax.launch --num_processes=2 --cpu_devices=4 -- \\
      --config=configs/quickstart.py:tiny --config.plan.mode=sequential --workdir=runs/mh

Everything after `--` goes to every process (`python -m pipe_rlhf_jax.main` by default),
followed by the flags that make them one job: `--coordinator_address=127.0.0.1:<free
port> --num_processes=N --process_id=i` (and `--cpu_devices=D` for D virtual CPU devices
per process). Process 0's output is shown live and every process's goes to
`<log_dir>/process_<i>.log`.

For development and tests, not clusters (there one process per host is started by the
cluster's own tools; see docs/multihost.md). It guarantees that nothing outlives it: when a
process fails, the others get `grace_s` to stop by themselves (they do, through the
job's fault handling) and are then SIGKILLed; the same happens to all of them after
`timeout_s`. A SIGINT (Ctrl-C) or SIGTERM to the launcher is passed on to every process,
which then finish their PPO step, write its checkpoint together and exit 130 / 143; the
launcher waits `stop_grace_s` for that before it SIGKILLs anything (the same signal
again is passed on too: the processes abort at once). It reports each process's exit
status and last milestone line, and exits with the first failure's status.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

MAIN = (sys.executable, "-u", "-m", "pipe_rlhf_jax.main")


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port nobody listens on right now (the OS picks it; a race with another
  program taking it before the coordinator does is possible but rare)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def describe_status(code: int | None) -> str:
  if code is None:
    return "still running"
  if code < 0:
    return f"killed by {signal.Signals(-code).name}"
  return f"exit {code}"


@dataclasses.dataclass
class LaunchResult:
  """What happened to each process.

  Attributes:
    returncodes: per process: the exit code, or -signal when a signal ended it.
    exit_s: per process: seconds from the launch to its end.
    logs: per process: its log file.
    first_failure: index of the first process that ended non-zero, or None.
    killed: indices the launcher SIGKILLed (they did not stop in time).
  """

  returncodes: list[int]
  exit_s: list[float]
  logs: list[str]
  first_failure: int | None
  killed: list[int]

  @property
  def ok(self) -> bool:
    return all(code == 0 for code in self.returncodes)

  def log_text(self, index: int) -> str:
    with open(self.logs[index], encoding="utf-8", errors="replace") as f:
      return f.read()

  def last_milestone(self, index: int) -> str:
    """The last line the process printed through `metrics.say` (its last known activity)."""
    lines = [line for line in self.log_text(index).splitlines()
             if line.startswith("[pipe_rlhf_jax")]
    return lines[-1] if lines else "(no milestone printed)"

  def report(self) -> str:
    lines = []
    for i, code in enumerate(self.returncodes):
      tag = " (SIGKILLed by the launcher)" if i in self.killed else ""
      lines.append(f"process {i}: {describe_status(code)}{tag} after {self.exit_s[i]:.1f}s; "
                   f"last: {self.last_milestone(i)}; log: {self.logs[i]}")
    if self.first_failure is not None:
      lines.insert(0, f"process {self.first_failure} failed first.")
    return "\n".join(lines)


def _tee(stream, path: str, echo: bool) -> None:
  with open(path, "wb") as f:
    for line in iter(stream.readline, b""):
      f.write(line)
      f.flush()
      if echo:
        sys.stdout.buffer.write(line)
        sys.stdout.flush()


def launch(args: Sequence[str], *, num_processes: int, cpu_devices: int = 0,
           log_dir: str = "runs/launch_logs", timeout_s: float = 3600.0,
           grace_s: float = 30.0, command: Sequence[str] = MAIN, echo: bool = True,
           env: dict[str, str] | None = None, host: str = "127.0.0.1",
           watch: Callable[[list[subprocess.Popen], list[str]], None] | None = None,
           stop_grace_s: float = 300.0) -> LaunchResult:
  """Runs `command + args + <job flags>` as `num_processes` processes and waits.

  Args:
    args: arguments for every process.
    num_processes: processes to start.
    cpu_devices: virtual CPU devices per process (0: leave the platform default).
    log_dir: where `process_<i>.log` go (created).
    timeout_s: SIGKILL everything still running after this long.
    grace_s: after the first failure, how long the others may take to stop by
      themselves before they are SIGKILLed.
    command: the program (default: the main job, unbuffered).
    echo: show process 0's output live.
    env: environment of the processes (default: this one's).
    host: the coordinator's address (loopback for local jobs).
    watch: called as `watch(processes, log paths)` every 0.1 s while the job runs (e.g.
      a preemption drill that SIGKILLs one process at a chosen moment).
    stop_grace_s: after a SIGINT / SIGTERM to the launcher (passed on to every process),
      how long the processes may take to write their final checkpoint and exit before
      they are SIGKILLed.

  Returns:
    A `LaunchResult`.
  """
  if num_processes < 1:
    raise ValueError(f"--num_processes={num_processes} must be >= 1.")
  os.makedirs(log_dir, exist_ok=True)
  address = f"{host}:{free_port(host)}"
  procs, logs, tees = [], [], []
  start = time.monotonic()
  for i in range(num_processes):
    job = [f"--coordinator_address={address}", f"--num_processes={num_processes}",
           f"--process_id={i}"]
    if cpu_devices:
      job.append(f"--cpu_devices={cpu_devices}")
    path = os.path.join(log_dir, f"process_{i}.log")
    proc = subprocess.Popen([*command, *args, *job], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    tee = threading.Thread(target=_tee, args=(proc.stdout, path, echo and i == 0),
                           daemon=True)
    tee.start()
    procs.append(proc)
    logs.append(path)
    tees.append(tee)

  exit_s: list[float | None] = [None] * num_processes
  first_failure, failed_at, killed = None, None, []
  # Signals to the launcher, passed on to the processes from the loop below.
  received: list[int] = []
  forwarded = [0]
  stop_at = [None]
  previous = {}
  if threading.current_thread() is threading.main_thread():
    for signum in (signal.SIGINT, signal.SIGTERM):
      previous[signum] = signal.getsignal(signum)
      signal.signal(signum, lambda signum, frame: received.append(signum))

  def kill(i: int) -> None:
    if procs[i].poll() is None:
      # The whole process group: a process's own children (e.g. data workers) go too.
      os.killpg(procs[i].pid, signal.SIGKILL)
      killed.append(i)

  try:
    while any(t is None for t in exit_s):
      now = time.monotonic() - start
      while forwarded[0] < len(received):
        signum = received[forwarded[0]]
        forwarded[0] += 1
        for proc in procs:
          if proc.poll() is None:
            proc.send_signal(signum)  # the process only: its own children are its own
        stop_at[0] = now + (stop_grace_s if forwarded[0] == 1 else min(stop_grace_s, 30.0))
      stopping = stop_at[0] is not None
      for i, proc in enumerate(procs):
        if exit_s[i] is None and proc.poll() is not None:
          exit_s[i] = now
          if proc.returncode != 0 and first_failure is None and not stopping:
            first_failure, failed_at = i, now
      if watch is not None:
        watch(procs, logs)
      if (now > timeout_s or (failed_at is not None and now > failed_at + grace_s)
          or (stopping and now > stop_at[0])):
        for i in range(num_processes):
          kill(i)
      time.sleep(0.1)
  finally:  # any error here leaves nothing running
    for signum, handler in previous.items():
      signal.signal(signum, handler)
    for i in range(num_processes):
      kill(i)
      procs[i].wait()
  for tee in tees:
    tee.join(timeout=5)
  codes = [p.returncode for p in procs]
  if first_failure is None and any(codes):
    first_failure = next(i for i, c in enumerate(codes) if c)
  return LaunchResult(codes, [float(t) for t in exit_s], logs, first_failure, killed)


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if "--" in argv:
    cut = argv.index("--")
    ours, theirs = argv[:cut], argv[cut + 1:]
  else:
    ours, theirs = argv, []
  parser = argparse.ArgumentParser(
      prog="python -m pipe_rlhf_jax.launch",
      description="Start a multi-process job of the main job on this machine (one process "
                  "per simulated host, joined by jax.distributed); the main job's flags "
                  "follow `--`. Ctrl-C / SIGTERM are passed on to every process, which "
                  "write a final checkpoint and stop.",
      epilog="example:\n  python -m pipe_rlhf_jax.launch --num_processes=2 --cpu_devices=4 -- "
             "\\\n      --config=configs/quickstart.py:tiny --workdir=runs/two",
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument("--cpu_devices", type=int, default=0,
                      help="virtual CPU devices per process (0: platform default)")
  parser.add_argument("--log_dir", default="runs/launch_logs")
  parser.add_argument("--timeout_s", type=float, default=3600.0)
  parser.add_argument("--grace_s", type=float, default=30.0,
                      help="after one process fails, how long the others may take to stop")
  parser.add_argument("--command", default=" ".join(MAIN),
                      help="the program every process runs (default: the main job)")
  parser.add_argument("--stop_grace_s", type=float, default=300.0,
                      help="after Ctrl-C / SIGTERM (passed on to every process), how long "
                           "they may take to write their final checkpoint")
  opts = parser.parse_args(ours)
  result = launch(theirs, num_processes=opts.num_processes, cpu_devices=opts.cpu_devices,
                  log_dir=opts.log_dir, timeout_s=opts.timeout_s, grace_s=opts.grace_s,
                  stop_grace_s=opts.stop_grace_s, command=shlex.split(opts.command))
  print(result.report(), file=sys.stderr)
  if result.ok:
    return 0
  code = result.returncodes[result.first_failure if result.first_failure is not None else 0]
  return code if code > 0 else 1


if __name__ == "__main__":
  sys.exit(main())
