"""Name -> function registries for the pluggable pieces of PPO.

Configs choose algorithm pieces by name (`config.ppo.kl_estimator = "k3"`,
`config.reward.fn = "reverse_accuracy"`); this module owns the lookup tables and the
error a user sees when a name is wrong.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Iterator, TypeVar

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
# Rule-based rewards on host: (prompts: list[str], completions: list[str]) -> np.ndarray [batch].
REWARD_FUNCTIONS: Registry = Registry("reward function")
