"""configs/calculator_tool.py: the tool-use config validates on the packaged model, the
model's chat template renders episodes turn by turn, and the tiny variant runs end to
end with the real model (slow tier)."""

import pytest

from configs import calculator_tool
from pipe_rlhf_jax.config import ExperimentSettings
from tests.configs.test_smollm2_rlvr import _installed


@pytest.mark.parametrize("variant", ["", "pipe", "tiny"])
def test_the_config_validates(variant):
  _installed()
  settings = ExperimentSettings.from_config(calculator_tool.get_config(variant))
  assert settings.env.name == "calculator" and settings.reward.uses_environment
  assert settings.data.word_problems.demo_style == "calculator"
  assert settings.plan.mode == ("pipe" if variant == "pipe" else "sequential")


def test_the_models_template_renders_episodes_turn_by_turn():
  from pipe_rlhf_jax.envs import Reply, renderer_for
  from pipe_rlhf_jax.models.load import load_tokenizer
  tok = load_tokenizer(str(_installed()))
  renderer = renderer_for(tok)  # the set-up check passes
  assert renderer.reply_text(Reply("391")) == (
      "\n<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_the_tiny_variant_runs_episodes_with_the_real_model(tmp_path):
  from pipe_rlhf_jax.train import train
  _installed()
  result = train(calculator_tool.get_config("tiny"), str(tmp_path), progress=False)
  assert len(result.ppo_metrics) == 2
  for m in result.ppo_metrics:
    assert m["env/turns"] >= 1 and m["env/policy_tokens"] > 0
  assert "held-out greedy calculator_tool_calls" in result.summary
