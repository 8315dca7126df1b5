"""Name -> function registries for the pluggable pieces of PPO.

Configs choose algorithm pieces by name (`config.ppo.kl_estimator = "k3"`,
`config.reward.fn = "reverse_accuracy"`); this module owns the lookup tables and the
error a user sees when a name is wrong.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
  """A named table of functions with a decorator to fill it.

  Args:
    kind: what the entries are, used in error messages ("reward function").
  """

  def __init__(self, kind: str):
    self.kind = kind
    self._entries: dict[str, F] = {}

  def register(self, name: str) -> Callable[[F], F]:
    """Decorator registering `fn` under `name`; a name can be registered once."""

    def decorator(fn: F) -> F:
      if name in self._entries and self._entries[name] is not fn:
        raise ValueError(f"{self.kind} {name!r} is already registered.")
      self._entries[name] = fn
      return fn

    return decorator

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
# (rewards, values, mask, gamma, lam) -> (advantages, returns).
ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")
# Policy objectives: see ppo/losses.py for the signature.
POLICY_LOSSES: Registry = Registry("policy loss")
# Rule-based rewards on host: (prompts: list[str], completions: list[str]) -> np.ndarray [batch].
REWARD_FUNCTIONS: Registry = Registry("reward function")
