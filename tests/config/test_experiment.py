"""ExperimentSettings.from_config: each bad field is named, and validation works in a fresh
process."""

import dataclasses
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "configs"))
import quickstart  # noqa: E402

from pipe_rlhf_jax.config.experiment import (  # noqa: E402
  SECTION_TYPES,
  TOP_LEVEL,
  DataSettings,
  ExperimentSettings,
)
from tests.helpers.configs import tiny_quickstart  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_builtin_reward_names_validate_in_a_fresh_process():
  # The reward names are checked against a registry that the rule modules fill on import;
  # a process that imports only the validation must still know the built-in rules.
  code = ("import sys; sys.path.insert(0, 'configs'); import quickstart\n"
          "from pipe_rlhf_jax.config import ExperimentSettings\n"
          "config = quickstart.get_config('tiny')\n"
          "config.reward.fn = 'reverse_accuracy'\n"
          "config.ppo.critic_init = 'sft'\n"
          "ExperimentSettings.from_config(config)\n")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=120, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("path, value", [
    ("ppo.epochs", 0), ("ppo.epochs", True),
    ("stages.generate.num_microbatches", 0), ("plan.max_staleness", -1),
    ("ppo.ptx_batch_size", -1),
])
def test_integer_fields_name_field_and_value(path, value):
  config = tiny_quickstart(overrides={path: value})
  with pytest.raises(ValueError, match=rf"{path}={value!r} must be an integer >= "):
    ExperimentSettings.from_config(config)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("path, value, allowed", [
    ("sft.learning_rate", NAN, "a number > 0"),
    ("reward_model.learning_rate", INF, "a number > 0"),
    ("ppo.temperature", INF, "a number >= 0"),
    ("ppo.top_p", NAN, r"a number in \(0, 1\]"),
    ("ppo.top_p", 1.5, r"a number in \(0, 1\]"),
    ("data.hard_pairs", NAN, r"a probability in \[0, 1\]"),
    ("reward_model.policy_pairs", INF, r"a fraction in \[0, 1\]"),
    ("plan.response_fraction", NAN, r"a number in \(0, 1\]"),
    ("ppo.actor_lr", NAN, "a number > 0"),  # the typed settings' check, the same words
])
def test_float_fields_refuse_nan_and_inf(path, value, allowed):
  config = tiny_quickstart(overrides={path: value})
  with pytest.raises(ValueError, match=rf"{path}={value!r} must be {allowed}"):
    ExperimentSettings.from_config(config)


def test_arith_demo_noise_refuses_nan():
  from configs import grpo_arith
  config = grpo_arith.get_config("tiny")
  config.data.arith.demo_noise = NAN
  with pytest.raises(ValueError, match=r"data.arith.demo_noise=nan must be a probability "
                                       r"in \[0, 1\]"):
    ExperimentSettings.from_config(config)


def test_grpo_arith_config_validates_and_fits_its_task():
  from configs import grpo_arith
  for variant in ("", "tiny"):
    ExperimentSettings.from_config(grpo_arith.get_config(variant))
  with pytest.raises(ValueError, match="variant 'big'"):
    grpo_arith.get_config("big")


@pytest.mark.parametrize("change, message", [
    (dict(fn="model"), r"data.task='arith' has no preference pairs.*reward.fn"),
    (dict(fn="reverse_exact"), r"reward.fn='reverse_exact' scores the embedded reverse"),
    (dict(eval_fn="reverse_accuracy"), r"reward.eval_fn='reverse_accuracy' scores the"),
])
def test_arith_task_refuses_rewards_of_other_tasks(change, message):
  from configs import grpo_arith
  config = grpo_arith.get_config("tiny")
  config.reward.update(change)
  with pytest.raises(ValueError, match=message):
    ExperimentSettings.from_config(config)


def test_arith_settings_and_rule_rewards_name_their_field():
  from configs import grpo_arith
  config = grpo_arith.get_config("tiny")
  config.data.arith.operators = "/"
  with pytest.raises(ValueError, match=r"data.arith.operators='/'"):
    ExperimentSettings.from_config(config)
  config = grpo_arith.get_config("tiny")
  del config.data["arith"]
  with pytest.raises(ValueError, match="needs a data.arith section"):
    ExperimentSettings.from_config(config)
  config = grpo_arith.get_config("tiny")
  config.data.num_eval = 151  # one-digit operands, three operators: 300 problems
  with pytest.raises(ValueError, match=r"data.num_eval=151 held-out problems is more than "
                                       r"half of the 300"):
    ExperimentSettings.from_config(config)
  # A critic cannot start from a reward model that a rule-reward run never trains; GRPO
  # builds no critic, so there the setting is moot.
  config = grpo_arith.get_config("tiny")
  config.ppo.critic_init = "reward_model"
  ExperimentSettings.from_config(config)
  config.ppo.update(advantage_estimator="gae", group_size=1, whiten_advantages=True)
  with pytest.raises(ValueError, match=r"critic_init='reward_model'.*critic_init=sft"):
    ExperimentSettings.from_config(config)
  # The reverse task scored by an arith rule is refused the same way.
  config = tiny_quickstart(overrides={"reward.fn": "arith_exact_match", "ppo.critic_init": "sft"})
  with pytest.raises(ValueError, match=r"reward.fn='arith_exact_match' scores the embedded "
                                       r"arith task only, but data.task='reverse'"):
    ExperimentSettings.from_config(config)


def test_hard_pairs_is_a_probability_of_the_reverse_task():
  config = tiny_quickstart(overrides={"data.hard_pairs": 1.5})
  with pytest.raises(ValueError, match=r"data.hard_pairs=1.5 must be a probability"):
    ExperimentSettings.from_config(config)
  from configs import grpo_arith
  config = grpo_arith.get_config("tiny")
  config.data.hard_pairs = 0.5  # a knob of the reverse task: other tasks ignore it
  ExperimentSettings.from_config(config)


def test_ptx_coef_must_be_a_non_negative_number():
  config = tiny_quickstart(overrides={"ppo.ptx_coef": -0.5})
  with pytest.raises(ValueError, match=r"ppo.ptx_coef=-0.5 must be a number >= 0"):
    ExperimentSettings.from_config(config)


def test_ptx_batch_that_does_not_split_is_refused_before_any_data(tmp_path):
  # The tiny PPO minibatch (8) on the 8 data shards of sequential mode: an explicit 4
  # demonstrations per gradient step cannot be split, found at set-up.
  from pipe_rlhf_jax.train import train
  config = tiny_quickstart("sequential", {"ppo.ptx_batch_size": 4})
  with pytest.raises(ValueError, match=r"ppo.ptx_batch_size: 4 demonstrations .* 8 batch "
                                       r"shards of the train stage .* multiple of 8"):
    train(config, str(tmp_path), progress=False)
  assert not os.path.exists(tmp_path / "data")  # before any data are built


def test_optional_fields_read_their_one_default_when_left_out():
  config = quickstart.get_config()
  del config.data["num_eval"]
  del config.plan["choose"]
  settings = ExperimentSettings.from_config(config)  # a config without them is still a valid one
  assert settings.data.num_eval == DataSettings.num_eval == 256
  assert settings.choice.choose == "manual"
  config.log.eval_prompts = 7
  assert ExperimentSettings.from_config(config).log.eval_prompts == 7
  required = quickstart.get_config()
  del required.ppo["batch_size"]
  with pytest.raises(ValueError, match="Config field ppo.batch_size is missing"):
    ExperimentSettings.from_config(required)
  # Every optional field's default passes the checks that field's given value gets.
  for section, cls in SECTION_TYPES.items():
    for f in dataclasses.fields(cls):
      if f.default is not dataclasses.MISSING and f.name in config[section]:
        del config[section][f.name]
  for name in ("choose", "hardware", "calibration", "response_fraction", "num_devices"):
    if name in config.plan:
      del config.plan[name]
  ExperimentSettings.from_config(config)


@pytest.mark.parametrize("section, typo, nearest", [
    ("ppo", "kl_coeff", "kl_coef"), ("plan", "max_stalenes", "max_staleness"),
    ("data", "prompt_length", "prompt_len"), ("log", "evry", "every"),
    ("model", "num_kv_head", "num_kv_heads"), ("stages.generate", "num_microbatch",
                                               "num_microbatches"),
    ("mesh", "tensr", "tensor"), (None, "rewards", "reward"),
])
def test_an_unknown_key_is_refused_with_the_nearest_known_one(section, typo, nearest):
  # A key a section does not know would otherwise leave the default silently in force.
  config = tiny_quickstart()
  node = config
  for part in (section.split(".") if section else ()):
    node = node[part]
  node[typo] = 1
  with pytest.raises(ValueError, match=rf"has unknown .*'{typo}': did you mean "
                                       rf"'{nearest}'\?"):
    ExperimentSettings.from_config(config)


def test_every_shipped_config_uses_known_keys_only():
  # (Keys only: hf_model and rlvr_math need a model directory to validate whole.)
  import grpo_arith
  import hf_model
  import rlvr_math

  from pipe_rlhf_jax.checks import check_known
  for config in (quickstart.get_config(), quickstart.get_config("tiny"),
                 grpo_arith.get_config(), hf_model.get_config(), rlvr_math.get_config()):
    check_known(config.keys(), TOP_LEVEL, "the config", "sections")
    for section, cls in SECTION_TYPES.items():
      if section in config:
        check_known(config[section].keys(), [f.name for f in dataclasses.fields(cls)],
                    section)


def test_model_path_is_a_gguf_file_or_a_directory_with_config_json(tmp_path):
  config = quickstart.get_config()
  config.model.path = str(tmp_path)  # an empty directory
  with pytest.raises(ValueError, match=r"model.path=.* is neither a GGUF file nor a "
                                       r"directory with a config.json"):
    ExperimentSettings.from_config(config)
  (tmp_path / "model.gguf").write_bytes(b"")  # the format is decided by the name here;
  assert ExperimentSettings.from_config(config).model.path == str(tmp_path)  # read later


def test_keys_of_an_earlier_release_are_refused_naming_their_new_name():
  config = quickstart.get_config()
  config["runtime"] = config.plan  # the section under its retired name
  del config["plan"]
  with pytest.raises(ValueError, match=r"Config key runtime was renamed plan \(and "
                     r"runtime.plan is now plan.choose\).*--config.plan="):
    ExperimentSettings.from_config(config)
  config = quickstart.get_config()
  config.plan.plan = "auto"
  with pytest.raises(ValueError, match=r"Config key plan.plan was renamed plan.choose"):
    ExperimentSettings.from_config(config)
  config = quickstart.get_config()
  config.stages.generate.mesh = {"data": 1, "pipe": 2}
  with pytest.raises(ValueError, match=r"Config key stages.generate.mesh.pipe was renamed "
                     r"stages.generate.mesh.pipeline"):
    ExperimentSettings.from_config(config)
