"""What an environment is: the interface multi-turn episodes talk to, its registry and
its settings.

An environment takes part in an episode between the policy's turns. It opens the
episode from the prompt (`start`), receives each assistant turn as the policy sampled it
(`step`: the turn's text and token ids) and answers with the next message, a tool's
result or a user's turn (`Reply`), or with None: the episode ends there. When an episode
has ended, for whatever reason, it gives the episode's reward (`reward`). Environments
are registered by name (`ENVIRONMENTS`, like the rule rewards) and chosen with
`env.name`; an environment class is built without arguments, once per run, and keeps
what one episode needs in the state `start` returns (episodes of a batch step in
parallel threads: an environment must not share mutable state between episodes).

`step` and `reward` are where tools run: the episode runner (`stages/episodes.py`) calls
them on host threads, every episode of a batch at once, each call bounded by
`env.tool_timeout_s` (`envs/tools.py`). A call that raises or runs out of time ends its
episode with a named reason and `env.failure_reward`; it never stops the job.

`EnvSettings` (the config section `env`) holds the episode limits.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, Mapping, Sequence

from pipe_rlhf_jax.checks import check_int, check_number, from_section
from pipe_rlhf_jax.ppo.registry import Registry

# Environment classes by name: `@ENVIRONMENTS.register("name")` on the class.
ENVIRONMENTS: Registry = Registry("environment")

# The roles a reply may take: a tool's result, or the user's next turn.
REPLY_ROLES = ("tool", "user")


@dataclasses.dataclass(frozen=True)
class Turn:
  """One assistant turn as the policy sampled it.

  Attributes:
    text: the turn's tokens decoded (special tokens dropped).
    tokens: the sampled ids, the closing EOS included when the turn ended on one.
    index: 0 for the episode's first turn.
    ended: the turn ended on EOS (False: it ran out of tokens).
  """

  text: str
  tokens: tuple[int, ...]
  index: int
  ended: bool


@dataclasses.dataclass(frozen=True)
class Reply:
  """The environment's answer to a turn: the next message of the conversation.

  Attributes:
    content: the message's text.
    role: "tool" (a tool's result) or "user" (the user's next turn).
  """

  content: str
  role: str = "tool"

  def __post_init__(self):
    if self.role not in REPLY_ROLES:
      raise ValueError(f"Reply role {self.role!r}: an environment replies as one of "
                       f"{REPLY_ROLES}.")
    if not isinstance(self.content, str):
      raise ValueError(f"Reply content must be a string, got {type(self.content).__name__}.")


class Environment(abc.ABC):
  """The interface of a multi-turn environment (see the module docstring).

  Subclasses implement `step` and `reward`; `start` defaults to a dict holding the
  prompt and its reference answer.
  """

  def start(self, prompt: str, answer: str | None) -> Any:
    """A new episode's state.

    Args:
      prompt: the prompt's text (its tokens decoded, chat markup dropped).
      answer: the prompt's reference answer, or None when the prompts carry none.
    """
    return {"prompt": prompt, "answer": answer}

  @abc.abstractmethod
  def step(self, state: Any, turn: Turn) -> Reply | None:
    """The reply to an assistant turn, or None to end the episode after it."""

  @abc.abstractmethod
  def reward(self, state: Any, turns: Sequence[Turn]) -> float:
    """The episode's reward, given every assistant turn it had (called once it ended)."""


def make_environment(name: str, field: str = "env.name") -> Environment:
  """The registered environment `name`, built; errors name `field` and the choices."""
  cls = ENVIRONMENTS.get(name, field=field)
  env = cls()
  if not isinstance(env, Environment):
    raise ValueError(f"{field}={name!r} is registered as {cls!r}, which is not an "
                     "envs.Environment: subclass it.")
  return env


@dataclasses.dataclass(frozen=True)
class EnvSettings:
  """`env`: multi-turn episodes with an environment (`envs/`, `stages/episodes.py`).

  Attributes:
    name: a registered environment (`envs.ENVIRONMENTS`), or "" for one-turn rollouts.
      With an environment, `reward.fn` is "environment": its reward is PPO's.
    max_turns: assistant turns per episode at most.
    turn_tokens: new tokens per assistant turn at most (0: the whole episode budget,
      `data.completion_len`, which bounds every token after the prompt: the policy's
      turns and the environment's replies).
    tool_timeout_s: each environment call (a `step`, a `reward`) may take this long;
      past it the episode ends as "tool_timeout".
    episode_timeout_s: an episode's wall time at most (0: no bound); checked between
      turns, the episode then ends as "wall_time".
    failure_reward: the reward of an episode whose environment call raised or timed out.
  """

  name: str = ""
  max_turns: int = 4
  turn_tokens: int = 0
  tool_timeout_s: float = 10.0
  episode_timeout_s: float = 0.0
  failure_reward: float = 0.0

  def __post_init__(self):
    if not isinstance(self.name, str):
      raise ValueError(f"env.name={self.name!r} must be a string ('' for none).")
    check_int(self.max_turns, "env.max_turns", low=1)
    check_int(self.turn_tokens, "env.turn_tokens", low=0)
    check_number(self.tool_timeout_s, "env.tool_timeout_s")
    check_number(self.episode_timeout_s, "env.episode_timeout_s", allow_zero=True)
    if (isinstance(self.failure_reward, bool)
        or not isinstance(self.failure_reward, (int, float))
        or not math.isfinite(self.failure_reward)):
      raise ValueError(f"env.failure_reward={self.failure_reward!r} must be a finite "
                       "number.")
    if self.name:
      ENVIRONMENTS.get(self.name, field="env.name")

  @classmethod
  def from_config(cls, section: Mapping[str, Any] | None, field: str = "env"
                  ) -> "EnvSettings":
    """From the config section (absent: no environment); errors name `field.<key>`."""
    return from_section(cls, section or {}, field, "env")

  @property
  def enabled(self) -> bool:
    return bool(self.name)

  def turn_budget(self, completion_len: int) -> int:
    """New tokens per assistant turn: `turn_tokens`, at most the episode's budget."""
    return min(self.turn_tokens or completion_len, completion_len)
