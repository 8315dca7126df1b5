"""The tests' one way to build the tiny quickstart config (`configs/quickstart.py:tiny`),
with a mode and dotted overrides as `--config.KEY=VALUE` would apply them."""

from collections.abc import Mapping
from typing import Any

import ml_collections

from configs import quickstart


def tiny_quickstart(mode: str | None = None,
                    overrides: Mapping[str, Any] | None = None) -> ml_collections.ConfigDict:
  """`configs/quickstart.py:tiny`, with `plan.mode` set where `mode` is given, then
  `overrides` ({"ppo.steps": 2, ...}) applied.

  An override of a key the config lacks raises KeyError, as the command line's would: left
  to itself, `update_from_flattened_dict` adds an unknown leaf, so a misspelt key would
  pass unread and leave the default in force.
  """
  config = quickstart.get_config("tiny")
  if mode is not None:
    config.plan.mode = mode
  if overrides:
    # Locked only while the overrides apply: tests may still add keys of their own after.
    config.lock()
    try:
      config.update_from_flattened_dict(dict(overrides))
    finally:
      config.unlock()
  return config
