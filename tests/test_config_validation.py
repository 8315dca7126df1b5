"""validate_config: each bad field is named, and validation works in a fresh process."""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
import quickstart  # noqa: E402

from pipe_rlhf_jax.config_validation import validate_config  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_builtin_reward_names_validate_in_a_fresh_process():
  # The reward names are checked against a registry that the rule modules fill on import;
  # a process that imports only the validation must still know the built-in rules.
  code = ("import sys; sys.path.insert(0, 'configs'); import quickstart\n"
          "from pipe_rlhf_jax.config_validation import validate_config\n"
          "config = quickstart.get_config('tiny')\n"
          "config.reward.fn = 'reverse_accuracy'\n"
          "validate_config(config)\n")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=120, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("path, value", [
    ("ppo.epochs", 0), ("ppo.epochs", True),
    ("stages.generate.num_microbatches", 0), ("runtime.max_staleness", -1),
])
def test_integer_fields_name_field_and_value(path, value):
  config = quickstart.get_config("tiny")
  section, name = path.rsplit(".", 1)
  config_section = config
  for part in section.split("."):
    config_section = config_section[part]
  config_section[name] = value
  with pytest.raises(ValueError, match=rf"{path}={value!r} must be an integer >= "):
    validate_config(config)
