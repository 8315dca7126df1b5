"""Config keys of an earlier release and what replaced them.

Owns `RENAMED_KEYS` and `check_renamed_keys`: a config that still uses a retired key is
refused with the new key's name, never read as an alias, so that one config means one
thing (docs/vocabulary.md lists the retired names). `ExperimentSettings.from_config`
runs the check before reading any section.
"""

from __future__ import annotations

# Keys a config of an earlier release used, and what replaced them: refused with the new
# name (never read as an alias, so one config means one thing).
RENAMED_KEYS = {"runtime": "plan", "runtime.plan": "plan.choose", "plan.plan": "plan.choose",
                "mesh.pipe": "mesh.pipeline", "warm_start.mesh.pipe": "warm_start.mesh.pipeline",
                **{f"stages.{s}.mesh.pipe": f"stages.{s}.mesh.pipeline"
                   for s in ("generate", "infer", "train")}}


def check_renamed_keys(config) -> None:
  """Raises ValueError naming the new key for each renamed one `config` still uses."""
  for old, new in RENAMED_KEYS.items():
    node, parts = config, old.split(".")
    for part in parts[:-1]:
      node = node.get(part) if hasattr(node, "get") else None
    if hasattr(node, "keys") and parts[-1] in node:
      hint = (" (and runtime.plan is now plan.choose)" if old == "runtime" else "")
      raise ValueError(f"Config key {old} was renamed {new}{hint}: rename it in the config "
                       f"file or on the command line (--config.{new}=...).")
