"""Every typed setting of the package, in one place to import from.

An experiment config (`configs/*.py`, an `ml_collections.ConfigDict`) is converted once,
at the edge, into the frozen dataclasses of this package; below that edge no code reads a
ConfigDict. Each setting checks itself when constructed, and its errors name the config
path (`ppo.clip_eps`) and what is allowed.

- `algorithm`: `PPOSettings`, the `ppo` section (the algorithm: estimators, losses, KL,
  batch sizes, learning rates).
- `plan`: `Plan` (the `plan`, `mesh` and `stages` sections: where and when the
  mathematics runs), its `StagePlan` and `MeshSpec`, and `PlannedRun` (a plan with the
  planner's prediction).
- `experiment`: `ExperimentSettings`, every section of one experiment config, and the
  sections that are not the algorithm's or the plan's (model, data, sft, reward_model,
  reward, warm_start, lora, env, checkpoint, log, PPO's sampling, how the plan is
  chosen).
- `defaults`: the config a config file starts from, every field at the default its class
  states, so that a file states only what differs.
- `retired`: config keys of an earlier release, refused with their new names.

The package sits directly above the algorithms (`ppo`, `generation`, `data`, `envs`):
the names of estimators, losses, rewards and environments are checked against the
algorithms' registries, so the settings come after what they name. Some settings are the
algorithms' own static arguments and are defined with them, re-exported here so that
every setting is imported from one place: `SamplingSettings` (`generation.sampler`),
`AdvantageSettings` (`ppo.advantages`), the generated tasks' `ArithSettings` /
`WordProblemSettings` (`data`) and the episodes' `EnvSettings` (`envs`).
Everything above (stages, system, phases, job, planner) imports settings from here.
"""

from pipe_rlhf_jax.config.algorithm import KL_PLACEMENTS, PPOSettings
from pipe_rlhf_jax.config.experiment import ExperimentSettings, LoRASettings
from pipe_rlhf_jax.config.plan import MODES, STAGES, MeshSpec, Plan, PlannedRun, StagePlan
from pipe_rlhf_jax.data.arith import ArithSettings
from pipe_rlhf_jax.data.word_problems import WordProblemSettings
from pipe_rlhf_jax.envs import EnvSettings
from pipe_rlhf_jax.generation.sampler import SamplingSettings
from pipe_rlhf_jax.ppo.advantages import AdvantageSettings

__all__ = ["AdvantageSettings", "ArithSettings", "EnvSettings", "ExperimentSettings",
           "KL_PLACEMENTS",
           "LoRASettings", "MODES", "MeshSpec", "PPOSettings", "Plan", "PlannedRun", "STAGES",
           "SamplingSettings", "StagePlan", "WordProblemSettings"]
