"""The main job on a local Hugging Face model directory (configs/hf_model.py), end to end."""

import os

import pytest

from configs import hf_model
from pipe_rlhf_jax import models
from pipe_rlhf_jax.train import train
from tests.helpers.hf_helpers import write_char_tokenizer, write_tiny_llama


@pytest.mark.slow
def test_rlhf_on_a_local_hf_llama(tmp_path):
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  torch.manual_seed(0)
  model_dir = tmp_path / "tiny-llama"
  model_dir.mkdir()
  tok = write_char_tokenizer(str(model_dir))
  hf_config = transformers.LlamaConfig(
      vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
      eos_token_id=tok.token_to_id("</s>"), bos_token_id=tok.token_to_id("<s>"),
      pad_token_id=tok.token_to_id("<pad>"))
  transformers.LlamaForCausalLM(hf_config).save_pretrained(str(model_dir))

  config = hf_model.get_config("tiny")
  config.model.path = str(model_dir)
  result = train(config, str(tmp_path / "run"), progress=False)
  assert len(result.ppo_metrics) == config.ppo.steps
  exported = models.from_pretrained(os.path.join(result.workdir, "export"))
  assert exported.config.num_layers == 2 and exported.config.vocab_size == 16


def test_hf_config_requires_a_model_path(tmp_path):
  with pytest.raises(ValueError, match="model.path"):
    train(hf_model.get_config("tiny"), str(tmp_path), progress=False)


def test_a_tokenizer_past_the_models_vocabulary_is_refused_at_set_up(tmp_path, capsys):
  # Tokens added to the tokenizer after the model was saved: their ids have no embedding
  # row (they would embed as NaN).
  tokenizers = pytest.importorskip("tokenizers")
  model_dir = write_tiny_llama(tmp_path / "tiny-llama")  # vocab_size 16, 16 tokens
  file = os.path.join(model_dir, "tokenizer.json")
  tok = tokenizers.Tokenizer.from_file(file)
  tok.add_tokens(["<tool>", "<call>"])
  tok.save(file)
  config = hf_model.get_config("tiny")
  config.model.path = model_dir
  config.model.tokenizer = "/some/other/tokenizer"
  with pytest.raises(ValueError, match=r"model.path=.*tiny-llama': its tokenizer has 18 ids "
                                       r"\(added tokens included\) but the model embeds 16 "
                                       r".*resize the model's embeddings to at least 18"):
    train(config, str(tmp_path / "run"), progress=False)
  assert not os.path.exists(tmp_path / "run" / "data")  # before any data are built
  assert ("model.tokenizer='/some/other/tokenizer' is ignored: model.path is set"
          in capsys.readouterr().out)
