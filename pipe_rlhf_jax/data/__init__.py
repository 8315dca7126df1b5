"""Data: the embedded tasks (reverse, arith), record validation, TFDS builders, grain loaders.

Importing this package registers the rule-based rewards ("reverse_accuracy",
"reverse_exact", "arith_exact_match", "arith_digit_accuracy", and "math_verify", which
checks completions against each prompt's reference answer) in
`ppo.registry.REWARD_FUNCTIONS`. The other names are loaded on first use, so
`python -m pipe_rlhf_jax.data.task` runs without importing its module twice, and
TFDS/grain load only when a dataset is built or a loader constructed.
"""

import importlib

from pipe_rlhf_jax.data import (
  math_reward,  # noqa: F401  (registers "math_verify")
  rewards,  # noqa: F401  (registers the reward functions)
)

_LAZY = {
    "ArithSettings": "arith",
    "make_arith_records": "arith",
    "write_arith_jsonl": "arith",
    "make_arith_datasets": "builders",
    "BuiltDataset": "builders",
    "build_dataset": "builders",
    "load_source": "builders",
    "make_task_datasets": "builders",
    "DemoLoader": "loaders",
    "PreferenceLoader": "loaders",
    "PromptLoader": "loaders",
    "FIELDS_BY_KIND": "records",
    "RecordValidator": "records",
    "make_task_records": "task",
    "write_task_jsonl": "task",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(f"pipe_rlhf_jax.data.{_LAZY[name]}"), name)
  raise AttributeError(f"module 'pipe_rlhf_jax.data' has no attribute {name!r}")
