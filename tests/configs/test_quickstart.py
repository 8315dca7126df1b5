"""The quickstart config, the one every shipped config starts from, states only what
differs from the settings' defaults (`pipe_rlhf_jax.config.defaults`), and every field is
still in it, so that the command line can set any."""

import ast
import pathlib

from configs import quickstart
from pipe_rlhf_jax.config import ExperimentSettings, Plan, PPOSettings
from pipe_rlhf_jax.config.defaults import defaults, section_defaults

SOURCE = pathlib.Path(quickstart.__file__)


def _assignments(source: str):
  """(dotted field, literal value) for each `config.a.b = <literal>` and
  `config.a.update(b=<literal>, ...)` of get_config."""
  tree = ast.parse(source)
  body = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_config")
  for node in ast.walk(body):
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
      target = ast.unparse(node.targets[0])
      try:
        yield target.removeprefix("config."), ast.literal_eval(node.value)
      except ValueError:
        continue
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr == "update"):
      section = ast.unparse(node.func.value).removeprefix("config.")
      for kw in node.keywords:
        try:
          yield f"{section}.{kw.arg}", ast.literal_eval(kw.value)
        except ValueError:
          continue


def test_the_quickstart_restates_no_default():
  base = defaults()
  restated = []
  for field, value in _assignments(SOURCE.read_text(encoding="utf-8")):
    node, parts = base, field.split(".")
    for part in parts[:-1]:
      node = node.get(part) if hasattr(node, "get") else None
    if hasattr(node, "keys") and parts[-1] in node:
      default = node[parts[-1]]
      default = default.to_dict() if hasattr(default, "to_dict") else default
      if default == value:
        restated.append(f"{field} = {value!r}")
  assert not restated, "configs/quickstart.py restates defaults:\n" + "\n".join(restated)


def test_every_field_with_a_default_can_be_set_on_the_command_line():
  config = quickstart.get_config()
  for name in section_defaults(PPOSettings):
    assert name in config.ppo, name
  for stage in ("generate", "infer", "train"):
    assert set(config.stages[stage]) >= {"attention", "remat", "num_slots", "pack_tokens"}


def test_a_config_of_defaults_reads_as_the_settings_classes_defaults():
  config = defaults()
  required = quickstart.get_config()
  for section in ("model", "data", "sft", "reward_model", "reward", "checkpoint", "log"):
    for key, value in required[section].items():
      if key not in config[section]:
        config[section][key] = value
  config.ppo.update(steps=1, batch_size=4, minibatch_size=4, critic_init="sft")
  settings = ExperimentSettings.from_config(config)
  assert settings.ppo == PPOSettings(steps=1, batch_size=4, minibatch_size=4)
  assert settings.plan == Plan()
