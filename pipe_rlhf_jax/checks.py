"""Argument checks shared by the config validation and the library's constructors.

Owns `check_int`, the one place that decides what counts as an integer setting (a
Python or numpy int, never a bool, at least `low`) and how a bad one is reported
("name=value must be an integer >= low."), and `check_number`, the same for real-valued
settings (finite: NaN passes every comparison and inf every lower bound), so every
field and argument fails alike, whether it comes from a config or a typed setting; and
`check_choice` for a setting that names one of a few options;
`check_fraction` for the response fraction, which the config, the planner and the plan all
accept; and `check_known`, how every section refuses a key it does not know (naming the
nearest known one: a typo reads as a typo).
Imports nothing heavy: config validation and data code call it before jax starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Iterable, Mapping

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


def check_number(value: Any, name: str, *, allow_zero: bool = False,
                 at_most: float | None = None, what: str = "a number",
                 hint: str = "") -> float:
  """Returns `value` as a float when it is a finite number > 0 (>= 0 with `allow_zero`)
  and at most `at_most`; raises ValueError naming it.

  Args:
    value: the setting to check (a Python or numpy int or float, never a bool).
    name: the config field or argument ("sft.learning_rate", "ppo.top_p").
    allow_zero: accept 0.
    at_most: the largest allowed value (None: unbounded above).
    what: what the value is, as the message says it ("a probability").
    hint: appended to the message (what the setting means, what to do instead).
  """
  # NaN passes every comparison below and inf every lower bound: refused first.
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
      or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero) or (
      at_most is not None and value > at_most):
    if at_most is None:
      allowed = ">= 0" if allow_zero else "> 0"
    else:
      allowed = f"in {'[' if allow_zero else '('}0, {at_most:g}]"
    raise ValueError(f"{name}={value!r} must be {what} {allowed}.{hint}")
  return float(value)


def check_choice(value: Any, name: str, choices: Iterable[Any]) -> Any:
  """Returns `value` when it is one of `choices`; raises ValueError naming it and them."""
  choices = list(choices)
  if value not in choices:
    raise ValueError(f"{name}={value!r}; choose one of {sorted(choices)}.")
  return value


def check_fraction(value, field: str) -> float:
  """`value` as a response fraction (mean response length over the longest) in (0, 1], or
  ValueError naming `field`."""
  return check_number(value, field, at_most=1.0,
                      hint=" It is the mean response length as a fraction of "
                           "data.completion_len (1 = no early EOS).")


def check_known(keys: Iterable[str], known: Iterable[str], field: str,
                what: str = "fields") -> None:
  """Raises ValueError when `keys` hold a name outside `known`, naming each unknown one's
  nearest known name: "ppo has unknown fields ['kl_coeff'] ('kl_coeff': did you mean
  'kl_coef'?); known: ...".

  Args:
    keys: the names given (a config section's keys).
    known: the names the section accepts.
    field: the section as the user wrote it ("ppo", "stages.generate.mesh").
    what: what the names are, for the message ("fields", "mesh axes").
  """
  known = list(known)
  unknown = sorted(set(keys) - set(known))
  if not unknown:
    return
  hints = []
  for name in unknown:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if close:
      hints.append(f"{name!r}: did you mean {close[0]!r}?")
  hint = f" ({'; '.join(hints)})" if hints else ""
  raise ValueError(f"{field} has unknown {what} {unknown}{hint}; known: {sorted(known)}.")


def from_section(cls, section: Mapping[str, Any], field: str, prefix: str):
  """`cls(**section)` for a frozen settings dataclass that checks itself with messages
  starting `prefix.`: unknown keys are refused and every message names `field.<key>`,
  the config path the user wrote."""
  values = dict(section)
  check_known(values, [f.name for f in dataclasses.fields(cls)], field)
  try:
    return cls(**values)
  except ValueError as e:
    if str(e).startswith(prefix + "."):
      raise ValueError(field + str(e)[len(prefix):]) from None
    raise


def plain(node: Any) -> dict:
  """A config section (a ConfigDict or any mapping) as a plain dict; leaves untouched."""
  return node.to_dict() if hasattr(node, "to_dict") else dict(node)
