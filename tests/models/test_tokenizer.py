"""Tests for models/tokenizer.py: byte round trips and a locally built HF tokenizer."""

import json

import numpy as np
import pytest

from pipe_rlhf_jax.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer


def test_byte_round_trip_including_non_ascii():
  tok = ByteTokenizer()
  text = "rev abc= héllo → 漢字 🙂"
  ids = tok.encode(text)
  assert len(ids) == len(text.encode("utf-8"))
  assert all(0 <= i < 256 for i in ids)
  assert tok.decode(ids) == text
  with_bos = tok.encode(text, add_bos=True)
  assert with_bos[0] == tok.bos_id and with_bos[1:] == ids
  # Specials are dropped by default and rendered on request; numpy rows work.
  row = np.array(with_bos + [tok.eos_id, tok.pad_id, tok.pad_id], dtype=np.int32)
  assert tok.decode(row) == text
  assert tok.decode(row, skip_special=False) == "<bos>" + text + "<eos><pad><pad>"


def test_byte_constants_and_protocol():
  tok = load_tokenizer("byte")
  assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (256, 257, 258)
  assert tok.vocab_size == 264 and tok.vocab_size % 8 == 0


def test_byte_decode_invalid_utf8_is_replaced_and_range_checked():
  tok = ByteTokenizer()
  # A lone continuation byte and a truncated multi-byte sequence split by a special.
  assert tok.decode([0x61, 0x80, 0x62]) == "a\ufffdb"
  euro = list("€".encode("utf-8"))
  assert tok.decode(euro[:2] + [tok.eos_id] + euro) == "\ufffd€"
  with pytest.raises(ValueError, match="outside"):
    tok.decode([264])


def _build_word_level(tmp_path, with_configs=True):
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import models, pre_tokenizers, trainers

  tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<pad>", "<s>", "</s>"])
  tok.train_from_iterator(["rev abc = cba", "rev hello world", "hello again world"], trainer)
  tok.save(str(tmp_path / "tokenizer.json"))
  if with_configs:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "</s>", "special": True}, "bos_token": "<s>"})
    )
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<pad>"}))
  return tok


def test_hf_tokenizer_from_directory(tmp_path):
  raw = _build_word_level(tmp_path)
  tok = load_tokenizer(str(tmp_path))
  assert isinstance(tok, HFTokenizer)
  assert tok.eos_id == raw.token_to_id("</s>")
  assert tok.bos_id == raw.token_to_id("<s>")
  assert tok.pad_id == raw.token_to_id("<pad>")
  assert tok.vocab_size == raw.get_vocab_size()
  ids = tok.encode("hello world")
  assert ids == [raw.token_to_id("hello"), raw.token_to_id("world")]
  assert tok.encode("hello world", add_bos=True) == [tok.bos_id] + ids
  assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == "hello world"
  assert "</s>" in tok.decode(ids + [tok.eos_id], skip_special=False)


def test_hf_tokenizer_ids_from_generation_config_and_pad_fallback(tmp_path):
  raw = _build_word_level(tmp_path, with_configs=False)
  eos = raw.token_to_id("</s>")
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 0]}))
  tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
  assert tok.eos_id == eos
  assert tok.pad_id == eos  # No pad anywhere: falls back to EOS.
  assert tok.bos_id is None
  assert tok.encode("hello", add_bos=True) == [raw.token_to_id("hello")]


def test_hf_tokenizer_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    load_tokenizer(str(tmp_path / "missing"))
  _build_word_level(tmp_path, with_configs=False)
  with pytest.raises(ValueError, match="EOS"):
    HFTokenizer(str(tmp_path))
  with pytest.raises(ValueError, match="not in the vocabulary"):
    HFTokenizer(str(tmp_path), eos_token="<never>")
  assert HFTokenizer(str(tmp_path), eos_token="</s>").eos_id == 3
