"""The config a config file starts from: every field that has a default, at that default.

Owns `defaults()`, an experiment `ConfigDict` built from the settings classes' own
defaults (each stated once, as a dataclass field's default). A config file starts from it
and states only what differs and what has no default (the model, the data, the warm
start's sizes, ...); every field is still present, so that any of them can be set on the
command line (`--config.ppo.clip_eps=0.1`; `ml_collections` overrides only keys that
exist). Fields without a default are left out: `ExperimentSettings.from_config` names the
one a file forgot ("Config field data.prompt_len is missing; add it").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from pipe_rlhf_jax.config.algorithm import PPOSettings
from pipe_rlhf_jax.config.experiment import (
  SECTION_TYPES,
  PlanChoice,
  PolicySamplingSettings,
)
from pipe_rlhf_jax.config.plan import STAGES, MeshSpec, Plan

# Fields whose default is decided elsewhere: the seed is the config's top-level `seed`.
_NOT_IN_SECTION = {PPOSettings: ("seed",)}


def _value(value: Any) -> Any:
  """A default as a config value: a settings dataclass as a dict of its fields, a tuple
  of pairs as a dict (a stage's `rules`), a tuple as a list."""
  if isinstance(value, MeshSpec):
    return value.as_dict()
  if dataclasses.is_dataclass(value):
    return {f.name: _value(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, tuple) and all(isinstance(v, tuple) and len(v) == 2 for v in value):
    return {k: _value(v) for k, v in value}
  if isinstance(value, (tuple, list)):
    return [_value(v) for v in value]
  return value


def section_defaults(cls, skip: tuple[str, ...] = ()) -> dict[str, Any]:
  """{field: default} of the fields of `cls` that have one (none for required fields)."""
  out = {}
  for f in dataclasses.fields(cls):
    if f.name in skip or f.name in _NOT_IN_SECTION.get(cls, ()):
      continue
    if f.default is not dataclasses.MISSING:
      out[f.name] = _value(f.default)
    elif f.default_factory is not dataclasses.MISSING:
      out[f.name] = _value(f.default_factory())
  return out


def defaults() -> ml_collections.ConfigDict:
  """An experiment config with every field that has a default, at its default.

  The sections of `ExperimentSettings` (model, data, sft, reward_model, reward,
  warm_start, checkpoint, log), `ppo` (`PPOSettings` and PPO's sampling), `plan` (`Plan`'s
  schedule and `PlanChoice`), `mesh` and `stages.<stage>` (`Plan()`'s meshes and each
  `StagePlan`'s fields). A `None` default (no placement, no arith task) stays `None`,
  which `ml_collections` lets a file or a flag replace by a value of any type.
  """
  sections: dict[str, Any] = {name: section_defaults(cls)
                              for name, cls in SECTION_TYPES.items()}
  sections["ppo"] = {**section_defaults(PPOSettings),
                     **section_defaults(PolicySamplingSettings)}
  plan = Plan()
  sections["plan"] = {**section_defaults(Plan, skip=("mesh",) + STAGES),
                      **section_defaults(PlanChoice)}
  sections["mesh"] = plan.mesh.as_dict()
  sections["stages"] = {s: _value(plan.stage(s)) for s in STAGES}  # every StagePlan field
  return ml_collections.ConfigDict(sections)
