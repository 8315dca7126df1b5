"""What the user's data files hold: content digests for the fingerprints and their checks.

The generated tasks (reverse, arith) are determined by their config. With
`data.task='jsonl'` the run reads the user's files, which may be edited in place under
the same path, so every fingerprint that decides whether a checkpoint belongs to a run
(the PPO resume's, `job.set_up`; the warm start's, `phases.warm_start`) hashes their
bytes instead of their paths (`with_content`), and each checkpoint records the digest
of every file it was made from (`file_digests`), so that a refusal can name the file
that changed (`changed_file`). Imports nothing heavy.
"""

from __future__ import annotations

import copy
import hashlib
import os
from typing import Any, Mapping

# The roles of data.jsonl; the preference files are read only with a reward model.
JSONL_ROLES = ("prompts", "prompts_eval", "demos", "prefs", "prefs_eval")
# The files the warm start learns from (SFT demonstrations, reward-model pairs).
WARM_START_ROLES = ("demos", "prefs", "prefs_eval")


def update_with_file(h, path: str) -> None:
  """Feeds the bytes of `path` to the hash `h`, a MiB at a time."""
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)


def file_sha256(path: str) -> str:
  """The SHA-256 of the bytes of `path`, as hex."""
  h = hashlib.sha256()
  update_with_file(h, path)
  return h.hexdigest()


def file_digests(files: Mapping[str, str]) -> dict[str, dict[str, str]]:
  """{field: {"path", "sha256"}} of the files {field: path} a run reads (the experiment
  settings' `data_files()`: "data.jsonl.<role>" -> path)."""
  return {field: {"path": os.path.abspath(path), "sha256": file_sha256(path)}
          for field, path in files.items()}


def with_content(config_dict: Mapping[str, Any], digests: Mapping[str, Mapping[str, str]]
                 ) -> dict[str, Any]:
  """`config_dict` with its `data.jsonl` section replaced by the files' digests.

  Nothing changes without digests (generated tasks), so their fingerprints stay as they
  were. With them, the same bytes under another path fingerprint alike, and an edited
  file differently; the roles not digested (files this fingerprint does not depend on)
  are left out.
  """
  out = copy.deepcopy(dict(config_dict))
  if digests:
    out["data"] = {**out["data"], "jsonl": {
        field.rsplit(".", 1)[1]: "sha256:" + d["sha256"] for field, d in digests.items()}}
  return out


def changed_file(saved: Mapping[str, Mapping[str, str]] | None,
                 current: Mapping[str, Mapping[str, str]]) -> str | None:
  """Which file differs from what a checkpoint was made from, in words; None if none.

  Args:
    saved: the digests the checkpoint recorded (None: it recorded none).
    current: this run's `file_digests`.
  """
  for field, now in current.items():
    before = (saved or {}).get(field)
    if before is not None and before["sha256"] != now["sha256"]:
      moved = (f" (then at {before['path']!r})" if before["path"] != now["path"] else "")
      return (f"{field}={now['path']!r} holds other data than it was made from{moved}: "
              f"sha256 {now['sha256'][:12]}... now, {before['sha256'][:12]}... then")
  return None
