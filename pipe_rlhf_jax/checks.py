"""Argument checks shared by the config validation and the library's constructors.

Owns `check_int`, the one place that decides what counts as an integer setting (a
Python or numpy int, never a bool, at least `low`) and how a bad one is reported
("name=value must be an integer >= low."), so every field and argument fails alike.
Imports nothing heavy: config validation and data code call it before jax starts.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def check_int(value: Any, name: str, *, low: int = 1, allow_none: bool = False,
              hint: str = "") -> Any:
  """Returns `value` as an int when it is an integer >= `low`; raises ValueError naming it.

  Args:
    value: the setting to check.
    name: the config field or argument, as the user wrote it ("ppo.epochs", "batch_size").
    low: the smallest allowed value (1 for counts and sizes, 0 for "may be none").
    allow_none: accept None (returned as is), e.g. "unbounded".
    hint: appended to the message (what None or 0 would mean, what to do instead).
  """
  if value is None and allow_none:
    return None
  # bool is an int subclass: `True` for a count is a typo, not 1.
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
    more = " (or None)" if allow_none else ""
    raise ValueError(f"{name}={value!r} must be an integer >= {low}{more}.{hint}")
  return int(value)
