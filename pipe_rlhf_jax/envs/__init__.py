"""Environments for multi-turn episodes: the interface, its registry, tools and rendering.

`base` defines what an environment is (`Environment`, `Turn`, `Reply`), the registry
`ENVIRONMENTS` and the `env` config section (`EnvSettings`); `tools` runs environment
calls on threads with a timeout; `render` turns the environment's messages into the
tokens that follow a sampled turn (token in, token out). Importing the package registers
the built-in environment, "calculator" (`calculator`). The episode loop that uses them
is `stages/episodes.py`.
"""

from pipe_rlhf_jax.envs import calculator  # noqa: F401  (registers "calculator")
from pipe_rlhf_jax.envs.base import (
  ENVIRONMENTS,
  Environment,
  EnvSettings,
  Reply,
  Turn,
  make_environment,
)
from pipe_rlhf_jax.envs.render import TemplateDriftError, renderer_for

__all__ = ["ENVIRONMENTS", "EnvSettings", "Environment", "Reply", "TemplateDriftError", "Turn",
           "make_environment", "renderer_for"]
