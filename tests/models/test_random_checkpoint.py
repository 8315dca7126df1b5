"""Published shapes and the random-weight Hugging Face directories written from them.

The directories are written at the published vocabulary (so the special-token ids sit
where the real tokenizers put them) with shrunken widths and 2 layers, and loaded by
this project and by transformers; the real Qwen3-0.6B shape runs once in the slow tier.
"""

import gc
import json

import jax.numpy as jnp
import numpy as np
import pytest

from pipe_rlhf_jax.models import from_pretrained, load_tokenizer, shapes
from pipe_rlhf_jax.models import random_checkpoint as rc
from pipe_rlhf_jax.models.safetensors_io import load_checkpoint_tensors
from pipe_rlhf_jax.planner import presets

TOL = 1e-4  # as tests/models/test_hf_parity.py
NEW_SHAPES = ("smollm2-135m", "qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b", "mistral-7b-v0.3")
CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}


def _small(name):
  """2 layers, 64 wide, GQA 4 / 2; head_dim != hidden / heads where the family allows."""
  arch = shapes.config(name).architecture
  return dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96,
              num_attention_heads=4, num_key_value_heads=2,
              head_dim=32 if arch in ("qwen3", "mistral") else 16)


# (layers, hidden, heads, kv heads, head_dim, mlp, vocab, tied, rope_theta, eps,
#  positions) of each published config.json.
PUBLISHED = {
    "smollm2-135m": (30, 576, 9, 3, 64, 1536, 49152, True, 1e5, 1e-5, 8192),
    "qwen2.5-0.5b": (24, 896, 14, 2, 64, 4864, 151936, True, 1e6, 1e-6, 32768),
    "qwen3-0.6b": (28, 1024, 16, 8, 128, 3072, 151936, True, 1e6, 1e-6, 40960),
    "llama-3.2-1b": (16, 2048, 32, 8, 64, 8192, 128256, True, 5e5, 1e-5, 131072),
    "mistral-7b-v0.3": (32, 4096, 32, 8, 128, 14336, 32768, False, 1e6, 1e-5, 32768),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_shapes(name):
  c = shapes.config(name)
  assert (c.num_layers, c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_dim,
          c.vocab_size, c.tie_embeddings, c.rope_theta, c.norm_eps,
          c.max_position_embeddings) == PUBLISHED[name]
  assert c.architecture == shapes.get(name).fields["model_type"]
  assert c.qkv_bias == (c.architecture == "qwen2") and not c.out_bias
  assert c.qk_norm == (c.architecture == "qwen3")
  if name == "llama-3.2-1b":
    assert dict(c.rope_scaling) == {"rope_type": "llama3", "factor": 32.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}
  else:
    assert c.rope_scaling is None
  # The planner prices the same table, in bf16.
  assert presets.model(name) == c.replace(dtype="bfloat16", param_dtype="bfloat16")


@pytest.mark.parametrize("name,total,non_embedding", [
    # The model cards' parameter counts (in billions, as rounded there).
    ("qwen2.5-0.5b", 0.49, 0.36), ("qwen3-0.6b", 0.6, 0.44), ("llama-3.2-1b", 1.24, None),
    ("smollm2-135m", 0.135, None), ("mistral-7b-v0.3", 7.25, None),
    ("llama2-7b", 6.74, None), ("llama2-70b", 69.0, None)])
def test_parameter_counts_match_the_model_cards(name, total, non_embedding):
  c = shapes.config(name)
  digits = len(str(total).split(".")[1])
  assert round(c.num_params() / 1e9, digits) == total
  if non_embedding is not None:
    embed = c.vocab_size * c.embed_dim
    assert round((c.num_params() - embed) / 1e9, 2) == non_embedding


@pytest.mark.parametrize("name", NEW_SHAPES)
def test_directory_loads_here_and_in_transformers(tmp_path, name):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  out = tmp_path / name
  config = rc.write_random_checkpoint(name, out, seed=1, overrides=_small(name))
  published = shapes.config(name)
  assert config.architecture == published.architecture
  assert config.vocab_size == published.vocab_size
  assert config.rope_scaling == published.rope_scaling

  ours = from_pretrained(out)
  assert ours.config == config
  tok = load_tokenizer(str(out))
  assert tok.vocab_size == config.vocab_size
  assert tok.eos_id == config.eos_token_id
  shape = shapes.get(name)
  assert tok.eos_id == shape.special_tokens[shape.eos_token]
  text = "Ünïcode and ASCII, 1 + 1 = 2\n"
  ids = tok.encode(text)
  assert len(ids) == len(text.encode()) and tok.decode(ids) == text

  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  assert len(hf_tok) == config.vocab_size and hf_tok.eos_token_id == config.eos_token_id
  assert hf_tok(text, add_special_tokens=False).input_ids == ids
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      out, dtype=torch.float32, attn_implementation="eager").eval()
  assert type(hf_model).__name__ == CLASSES[config.architecture]
  tokens = np.asarray([ids[:7], tok.encode("ab", add_bos=True) + ids[:4]])
  with torch.no_grad():
    ref = hf_model(torch.tensor(tokens)).logits.numpy()
  got = np.asarray(ours(jnp.asarray(tokens)))
  assert float(np.abs(got - ref).max()) <= TOL
  assert float(np.abs(ref).max()) > 1e-3  # the weights really are random, not zeros


def test_chat_shape_has_a_template(tmp_path):
  transformers = pytest.importorskip("transformers")
  rc.write_random_checkpoint("qwen3-0.6b", tmp_path, overrides=_small("qwen3-0.6b"))
  side = json.loads((tmp_path / "tokenizer_config.json").read_text())
  assert side["eos_token"] == "<|im_end|>" and "chat_template" in side
  hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
  ids = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True,
                                   add_generation_prompt=True)
  ids = ids["input_ids"] if hasattr(ids, "keys") else ids
  assert ids[0] == 151644 and 151645 in ids  # <|im_start|> ... <|im_end|>


def test_shards_hold_the_same_values_as_one_file(tmp_path):
  small = _small("llama-3.2-1b")
  rc.write_random_checkpoint("llama-3.2-1b", tmp_path / "one", seed=3, dtype="float32",
                             overrides=small)
  rc.write_random_checkpoint("llama-3.2-1b", tmp_path / "many", seed=3, dtype="float32",
                             overrides=small, max_shard_bytes=64 * 1024)
  index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
  files = set(index["weight_map"].values())
  assert len(files) > 2 and not (tmp_path / "many" / "model.safetensors").exists()
  one = load_checkpoint_tensors(tmp_path / "one")
  many = load_checkpoint_tensors(tmp_path / "many")
  assert sorted(one) == sorted(many)
  for key, value in one.items():
    np.testing.assert_array_equal(value, many[key], err_msg=key)
  norm = one["model.layers.0.input_layernorm.weight"]
  np.testing.assert_array_equal(norm, 1.0)
  q = one["model.layers.0.self_attn.q_proj.weight"]
  assert 0.015 < float(q.std()) < 0.025
  rc.write_random_checkpoint("llama-3.2-1b", tmp_path / "other", seed=4, dtype="float32",
                             overrides=small)
  other = load_checkpoint_tensors(tmp_path / "other")
  assert not np.array_equal(other["model.layers.0.self_attn.q_proj.weight"], q)


def test_refusals(tmp_path):
  with pytest.raises(ValueError, match="unknown model shape 'gpt-5'"):
    rc.write_random_checkpoint("gpt-5", tmp_path / "a")
  with pytest.raises(ValueError, match=r"cannot override \['rope_theta'\]"):
    rc.write_random_checkpoint("qwen3-0.6b", tmp_path / "b", overrides={"rope_theta": 1.0})
  with pytest.raises(ValueError, match="do not fit vocab_size=1000"):
    rc.write_random_checkpoint("qwen3-0.6b", tmp_path / "c",
                               overrides={**_small("qwen3-0.6b"), "vocab_size": 1000})
  (tmp_path / "d").mkdir()
  (tmp_path / "d" / "notes.txt").write_text("mine")
  with pytest.raises(FileExistsError, match="not empty"):
    rc.write_random_checkpoint("smollm2-135m", tmp_path / "d")


def test_command_line(tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_:
    rc.main(["--help"])
  assert exit_.value.code == 0
  text = capsys.readouterr().out
  assert "--shape qwen3-0.6b --out" in text and "mistral-7b-v0.3" in text
  small = _small("smollm2-135m")
  args = ["--shape", "smollm2-135m", "--out", str(tmp_path / "cli"), "--seed", "2",
          "--dtype", "float32"] + [f"--set={k}={v}" for k, v in small.items()]
  assert rc.main(args) == 0
  assert "smollm2-135m" in capsys.readouterr().out
  config = json.loads((tmp_path / "cli" / "config.json").read_text())
  assert config["num_hidden_layers"] == 2 and config["torch_dtype"] == "float32"
  assert from_pretrained(tmp_path / "cli").config.vocab_size == 49152


# Extended: a real model's size against transformers stays in CI with the packaged
# SmolLM2-135M-Instruct file (slow tier), Qwen3's mathematics with the tiny Qwen3 parity
# (default tier).
@pytest.mark.long
@pytest.mark.slow
@pytest.mark.extended
def test_real_qwen3_shape_forward_matches_transformers(tmp_path):
  """Qwen3-0.6B's exact shape (random bf16 weights): one forward of a few tokens.

  Peak resident memory about 5 GB (4.9 GB measured): transformers' f32 model is freed
  before ours (bf16 storage, f32 compute: the same values) is built.
  """
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.set_num_threads(2)
  out = tmp_path / "qwen3-0.6b"
  config = rc.write_random_checkpoint("qwen3-0.6b", out, dtype="bfloat16")
  assert config.num_params() == 596_049_920
  tokens = np.asarray([[151644, 872, 198, 9707, 151645, 198]])
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      out, dtype=torch.float32, attn_implementation="eager").eval()
  with torch.no_grad():
    ref = hf_model(torch.tensor(tokens)).logits.numpy()
  del hf_model
  gc.collect()
  ours = from_pretrained(out, param_dtype="bfloat16")
  got = np.asarray(ours(jnp.asarray(tokens)))
  assert got.shape == (1, 6, 151936)
  assert float(np.abs(got - ref).max()) <= TOL
