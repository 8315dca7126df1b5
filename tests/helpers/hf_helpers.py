"""Tiny local Hugging Face model directories for tests (no hub, no torch needed)."""

import json
import os

import pytest


def write_char_tokenizer(path):
  """A character-level tokenizer.json (+ tokenizer_config.json) covering the reverse task."""
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import decoders, pre_tokenizers
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
  tok.decoder = decoders.Fuse()
  trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<s>", "</s>"])
  tok.train_from_iterator(["rev abcdefgh= hgfedcba"], trainer)
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "</s>", "bos_token": "<s>", "pad_token": "<pad>"}, f)
  return tok


def write_tiny_llama(path, seed: int = 0) -> str:
  """A 2-layer LLaMA (vocab 16) saved in Hugging Face format by this project's exporter."""
  from pipe_rlhf_jax import models
  os.makedirs(path, exist_ok=True)
  tok = write_char_tokenizer(path)
  cfg = models.tiny_config(vocab_size=16, embed_dim=32, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8, mlp_dim=64,
                           eos_token_id=tok.token_to_id("</s>"),
                           bos_token_id=tok.token_to_id("<s>"),
                           pad_token_id=tok.token_to_id("<pad>"))
  models.save_pretrained(models.init_model(cfg, seed=seed), path)
  return str(path)


def write_chat_tokenizer(path, corpus: str, special_tokens, *, eos: str, bos: str | None = None,
                         pad: str | None = None, chat_template: str | None = None,
                         template_file: bool = False):
  """A character-level tokenizer.json covering `corpus`, with added special tokens.

  Every character of `corpus` (newlines included) is one token; `special_tokens` are
  added tokens matched whole in text, as chat markers are. The template goes into
  tokenizer_config.json, or into chat_template.jinja with `template_file`.
  """
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import decoders, pre_tokenizers
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
  tok.decoder = decoders.Fuse()
  trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>"])
  tok.train_from_iterator([corpus], trainer)
  tok.add_special_tokens([t for t in special_tokens if t != "<unk>"])
  os.makedirs(path, exist_ok=True)
  tok.save(os.path.join(path, "tokenizer.json"))
  config = {"eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}
  if bos is not None:
    config["bos_token"] = bos
  if pad is not None:
    config["pad_token"] = pad
  if chat_template is not None and not template_file:
    config["chat_template"] = chat_template
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)
  if chat_template is not None and template_file:
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
      f.write(chat_template)
  return tok


# A ChatML chat template (the <|im_start|> format of Qwen-style chat models).
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_chat_llama(path, corpus: str, seed: int = 0,
                          chat_template: str = CHATML_TEMPLATE) -> str:
  """A 2-layer LLaMA with a character-level ChatML tokenizer covering `corpus`."""
  from pipe_rlhf_jax import models
  tok = write_chat_tokenizer(path, corpus, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                             eos="<|im_end|>", pad="<|endoftext|>",
                             chat_template=chat_template)
  vocab = -(-tok.get_vocab_size() // 8) * 8  # splits evenly over tensor axes of 2, 4, 8
  cfg = models.tiny_config(vocab_size=vocab, embed_dim=32, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8, mlp_dim=64,
                           eos_token_id=tok.token_to_id("<|im_end|>"), bos_token_id=None,
                           pad_token_id=tok.token_to_id("<|endoftext|>"))
  models.save_pretrained(models.init_model(cfg, seed=seed), path)
  return str(path)
