"""One run per workdir: the lock a run holds on its output directory.

Owns `WorkdirLock`. Two runs writing one workdir (a second launch with the same
`--workdir` before the first has written a checkpoint, which the "already holds
checkpoints" check cannot see yet) would swap `metrics.jsonl`, traces and exports under
each other. The lock is an advisory `flock` on `<workdir>/.lock`: the kernel releases it
when the holding process ends in any way (SIGKILL included), so a crashed run never
leaves a stale lock behind; the file records who holds it (pid, host, start time) for the
refusal's message.

In a multi-process job only process 0 takes the lock (every process shares its workdir).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time

LOCK_NAME = ".lock"


class WorkdirBusy(RuntimeError):
  """Another live run holds the workdir."""


class WorkdirLock:
  """Holds `<workdir>/.lock` until `release()` (or the process ends).

  Raises:
    WorkdirBusy: another process holds it; names that process and its host.
  """

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_NAME)
    self._file = open(self.path, "a+", encoding="utf-8")  # pylint: disable=consider-using-with
    try:
      fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      self._file.seek(0)
      holder = self._file.read().strip()
      self._file.close()
      try:
        who = json.loads(holder)
        desc = (f"process {who['pid']} on {who['host']} (started "
                f"{who['started']}, command: {who.get('command', '?')})")
      except (ValueError, KeyError, TypeError):
        desc = "another process"
      raise WorkdirBusy(
          f"{workdir} is in use by {desc}: two runs in one workdir would overwrite each "
          "other's metrics and checkpoints. Wait for it to end (or stop it), or choose "
          "another --workdir.") from None
    self._file.seek(0)
    self._file.truncate()
    json.dump({"pid": os.getpid(), "host": socket.gethostname(),
               "started": time.strftime("%Y-%m-%d %H:%M:%S"),
               "command": " ".join(sys.argv)[:300]}, self._file)
    self._file.flush()

  def release(self) -> None:
    if self._file.closed:
      return
    try:
      self._file.seek(0)
      self._file.truncate()
      fcntl.flock(self._file, fcntl.LOCK_UN)
    finally:
      self._file.close()
