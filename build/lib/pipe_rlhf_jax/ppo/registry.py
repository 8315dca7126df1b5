"""Name -> function registries for the pluggable pieces of PPO.

Configs choose algorithm pieces by name (`config.ppo.kl_estimator = "k3"`,
`config.reward.fn = "reverse_accuracy"`); this module owns the lookup tables and the
error a user sees when a name is wrong, and `score_rule`, the one way a rule reward is
called: `fn(prompts, completions)`, or `fn(prompts, completions, answers)` for a rule that
checks each completion against its prompt's reference answer; its scores are checked
where they are computed (one finite score per completion), since a NaN would otherwise
spread through the batch's advantage whitening to every sample and surface much later as
a diverged update.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

import numpy as np

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
  """A named table of functions with a decorator to fill it.

  An entry may carry static facts about itself (`info`), which the system reads to decide
  what to build: e.g. an advantage estimator says whether it needs a critic.

  Args:
    kind: what the entries are, used in error messages ("reward function").
    defaults: the facts an entry has when its registration does not state them.
  """

  def __init__(self, kind: str, **defaults: Any):
    self.kind = kind
    self._entries: dict[str, F] = {}
    self._defaults = defaults
    self._info: dict[str, dict[str, Any]] = {}

  def register(self, name: str, **info: Any) -> Callable[[F], F]:
    """Decorator registering `fn` under `name` (once), with facts `info` about it."""
    unknown = sorted(set(info) - set(self._defaults))
    if unknown:
      raise ValueError(f"{self.kind} {name!r}: unknown registration facts {unknown}; "
                       f"known: {sorted(self._defaults)}.")

    def decorator(fn: F) -> F:
      if name in self._entries and self._entries[name] is not fn:
        raise ValueError(f"{self.kind} {name!r} is already registered.")
      self._entries[name] = fn
      self._info[name] = {**self._defaults, **info}
      return fn

    return decorator

  def info(self, name: str, *, field: str | None = None) -> dict[str, Any]:
    """The facts registered with `name` (defaults filled in); raises like `get`."""
    self.get(name, field=field)
    return dict(self._info[name])

  def get(self, name: str, *, field: str | None = None) -> F:
    """Returns the entry for `name`, or raises naming the config field and the choices."""
    try:
      return self._entries[name]
    except KeyError:
      where = f" (config field {field})" if field else ""
      raise ValueError(
          f"Unknown {self.kind} {name!r}{where}; choose one of {sorted(self._entries)}."
      ) from None

  def name_of(self, entry: Any) -> str | None:
    """The name `entry` is registered under, or None."""
    return next((name for name, fn in self._entries.items() if fn is entry), None)

  def names(self) -> list[str]:
    return sorted(self._entries)

  def __contains__(self, name: str) -> bool:
    return name in self._entries

  def __iter__(self) -> Iterator[str]:
    return iter(sorted(self._entries))


# (logprobs, ref_logprobs) -> per-token KL estimate.
KL_ESTIMATORS: Registry = Registry("KL estimator")
# (rewards, values, mask, settings: AdvantageSettings) -> (advantages, returns); see
# ppo/advantages.py. `needs_critic=False` entries get values=None and the system builds no
# critic; `normalises=True` entries define their own scale (group or batch
# normalisation), so `ppo.whiten_advantages` must stay off for them.
ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator", needs_critic=True,
                                          normalises=False)
# Policy objectives: see ppo/losses.py for the signature.
POLICY_LOSSES: Registry = Registry("policy loss")
# (per_token [batch, length], mask, norm_len) -> scalar; see ppo/aggregation.py.
LOSS_AGGREGATIONS: Registry = Registry("loss aggregation")
# Rule-based rewards on host: (prompts: list[str], completions: list[str]) -> np.ndarray
# [batch], or with a third parameter `answers: list[str]` (see `score_rule`).
REWARD_FUNCTIONS: Registry = Registry("reward function")


def _clip(text: str, limit: int = 80) -> str:
  return text if len(text) <= limit else text[:limit] + "..."


def rule_answers(fn: Callable) -> str:
  """How a rule reward takes reference answers: "required" (a parameter `answers`
  without a default), "optional" (`answers` with a default, or `**kwargs`) or "no"."""
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):  # builtins without a signature take what they take
    return "no"
  if "answers" in params:
    return "optional" if params["answers"].default is not inspect.Parameter.empty else "required"
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
    return "optional"
  return "no"


def score_rule(fn: Callable, prompts: Sequence[str], completions: Sequence[str],
               answers: Sequence[str] | None = None, dtype=np.float32) -> np.ndarray:
  """Calls a rule reward by its convention; `dtype` [batch], checked.

  `answers` (each row's reference answer, None when the prompts carry none) is passed as
  the keyword `answers` to a rule that takes it, and never to one that does not, so the
  rules written for `(prompts, completions)` keep working on data with answers.

  Raises:
    ValueError: the rule needs answers but there are none (naming the rule and the fix);
      it does not return one score per completion; or a score is NaN or infinite (in
      `dtype`), naming the rule (its registered name) with that sample's prompt and
      completion.
  """
  name = REWARD_FUNCTIONS.name_of(fn) or getattr(fn, "__name__", repr(fn))
  takes = rule_answers(fn)
  if answers is not None and len(answers) != len(completions):
    raise ValueError(f"{len(answers)} answers for {len(completions)} completions.")
  if takes == "required" and answers is None:
    raise ValueError(
        f"The rule reward {name!r} checks each completion against its prompt's reference "
        "answer, but the prompts carry none: give every prompt record an 'answer' field "
        "(data.task='jsonl', e.g. {\"prompt\": ..., \"answer\": \"42\"}).")
  with np.errstate(over="ignore"):  # a score beyond `dtype` becomes inf, reported below
    if takes != "no" and answers is not None:
      scores = fn(list(prompts), list(completions), answers=list(answers))
    else:
      scores = fn(list(prompts), list(completions))
    scores = np.asarray(scores, dtype)
  if scores.shape != (len(completions),):
    raise ValueError(f"reward function {name!r} returned scores of shape {scores.shape} for "
                     f"{len(completions)} completions; it must return one score per "
                     "completion, [batch].")
  bad = np.flatnonzero(~np.isfinite(scores))
  if bad.size:
    i = int(bad[0])
    raise ValueError(
        f"reward function {name!r} scored completion {i} of the batch {scores[i]} "
        f"(prompt {_clip(prompts[i])!r}, completion {_clip(completions[i])!r}"
        f"{f'; {bad.size} non-finite scores in all' if bad.size > 1 else ''}); a rule "
        "reward must give every completion a finite score: fix the rule (e.g. score an "
        "answer it cannot parse 0).")
  return scores
