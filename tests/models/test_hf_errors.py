"""models/hf.py refuses checkpoints it cannot reproduce exactly, naming the culprit."""

import json
import warnings

import pytest

from pipe_rlhf_jax.models import hf, hf_config
from pipe_rlhf_jax.models.config import TransformerConfig
from pipe_rlhf_jax.models.transformer import init_model

BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 40,
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def _config(**changes):
  config = dict(BASE)
  config.update(changes)
  return config


@pytest.fixture
def ckpt(tmp_path):
  """A valid tiny LLaMA checkpoint written by save_pretrained."""
  config = TransformerConfig(vocab_size=40, embed_dim=32, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=8, mlp_dim=48)
  hf.save_pretrained(init_model(config), tmp_path)
  return tmp_path


def _edit_tensors(path, edit):
  tensors = hf.read_safetensors(path / "model.safetensors")
  edit(tensors)
  hf.write_safetensors(path / "model.safetensors", tensors)


def test_valid_checkpoint_loads(ckpt):
  assert hf.from_pretrained(ckpt).config.num_layers == 2


def test_unsupported_architecture():
  with pytest.raises(ValueError, match="GemmaForCausalLM") as err:
    hf_config.config_from_hf(_config(architectures=["GemmaForCausalLM"]))
  for name in hf_config.SUPPORTED_ARCHITECTURES:
    assert name in str(err.value)


def test_missing_tensor(ckpt):
  _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj"
                                       r"\.weight' \(expected shape \(48, 32\)\)"):
    hf.from_pretrained(ckpt)


def test_misshapen_tensor(ckpt):
  def edit(t):
    t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"]
  _edit_tensors(ckpt, edit)
  with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight': "
                                       r"expected shape \(16, 32\), got \(32, 32\)"):
    hf.from_pretrained(ckpt)


def test_unexpected_tensor(ckpt):
  def edit(t):
    t["model.layers.0.self_attn.o_proj.bias"] = t["model.norm.weight"]
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = t["model.norm.weight"][:4]
  _edit_tensors(ckpt, edit)
  with pytest.raises(ValueError) as err:
    hf.from_pretrained(ckpt)
  assert "unexpected tensor 'model.layers.0.self_attn.o_proj.bias'" in str(err.value)
  assert "inv_freq" not in str(err.value)  # rotary buffers are ignored


def test_tied_head_that_differs(ckpt):
  config = json.loads((ckpt / "config.json").read_text())
  config["tie_word_embeddings"] = True
  (ckpt / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="lm_head.weight differs"):
    hf.from_pretrained(ckpt)


@pytest.mark.parametrize("rope_field", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("kind", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_type(rope_field, kind):
  with pytest.raises(ValueError, match=rf"{rope_field}\.rope_type='{kind}'"):
    hf_config.config_from_hf(_config(**{rope_field: {"rope_type": kind, "factor": 2.0}}))


def test_llama3_rope_missing_parameter():
  with pytest.raises(ValueError, match="low_freq_factor"):
    hf_config.config_from_hf(_config(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                            "high_freq_factor": 4.0}))


@pytest.mark.parametrize("field,value", [
    ("mlp_bias", True), ("hidden_act", "gelu"), ("partial_rotary_factor", 0.5),
    ("quantization_config", {"quant_method": "gptq"})])
def test_math_changing_field(field, value):
  with pytest.raises(ValueError, match=field):
    hf_config.config_from_hf(_config(**{field: value}))


def test_neutral_values_of_math_fields_load():
  config = hf_config.config_from_hf(_config(mlp_bias=False, hidden_act="silu",
                                     pretraining_tp=4, attention_dropout=0.0))
  assert config.mlp_dim == 48


def test_sliding_window():
  qwen = _config(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                 max_position_embeddings=4096, use_sliding_window=True,
                 sliding_window=1024, max_window_layers=1)
  # transformers' rule: layers i >= max_window_layers slide.
  config = hf_config.config_from_hf(qwen)
  assert config.sliding_window == 1024 and config.local_layers == (False, True)
  # No layer slides, or the switch is off: full attention.
  for off in ({"max_window_layers": 2}, {"use_sliding_window": False}):
    assert hf_config.config_from_hf({**qwen, **off}).sliding_window is None
  # `layer_types`, when present, is what counts.
  assert hf_config.config_from_hf({**qwen, "layer_types": ["sliding_attention", "full_attention"]}
                           ).local_layers == (True, False)
  with pytest.raises(ValueError, match="chunked_attention"):
    hf_config.config_from_hf({**qwen, "layer_types": ["chunked_attention"] * 2})


MISTRAL = _config(architectures=["MistralForCausalLM"], model_type="mistral",
                  max_position_embeddings=32768)


def test_mistral_sliding_window():
  # Mistral-7B-v0.1's window: every layer sees only the last 4096 keys, even with a
  # Qwen-style switch saying no: transformers' Mistral does not read it.
  for extra in ({}, {"use_sliding_window": False}):
    config = hf_config.config_from_hf({**MISTRAL, "sliding_window": 4096, **extra})
    assert config.sliding_window == 4096 and all(config.local_layers)
  # Absent means transformers' default window (4096) and context (131072).
  config = hf_config.config_from_hf({k: v for k, v in MISTRAL.items()
                              if k != "max_position_embeddings"})
  assert (config.sliding_window, config.max_position_embeddings) == (4096, 131072)
  config = hf_config.config_from_hf({**MISTRAL, "sliding_window": None})
  assert config.sliding_window is None and not any(config.local_layers)


def test_mistral_attention_bias_is_refused():
  with pytest.raises(ValueError, match="attention_bias=True"):
    hf_config.config_from_hf({**MISTRAL, "sliding_window": None, "attention_bias": True})
  assert not hf_config.config_from_hf({**MISTRAL, "sliding_window": None,
                                "attention_bias": False}).out_bias


def test_mistral_head_dim_and_defaults():
  config = hf_config.config_from_hf({**MISTRAL, "sliding_window": None, "head_dim": None})
  assert (config.head_dim, config.num_kv_heads) == (8, 2)
  assert (config.bos_token_id, config.eos_token_id) == (1, 2)  # transformers' defaults
  bare = {k: v for k, v in MISTRAL.items() if k != "num_key_value_heads"}
  config = hf_config.config_from_hf({**bare, "num_attention_heads": 8, "hidden_size": 64,
                              "head_dim": 16, "sliding_window": None})
  assert (config.head_dim, config.num_kv_heads) == (16, 8)


QWEN3 = _config(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16)


def test_qwen3_policy():
  config = hf_config.config_from_hf(QWEN3)
  assert config.qk_norm and config.head_dim == 16 and not config.qkv_bias
  assert config.max_position_embeddings == 32768  # transformers' default
  # Absent head_dim is transformers' Qwen3 default of 128, not hidden / heads.
  no_head_dim = {k: v for k, v in QWEN3.items() if k != "head_dim"}
  assert hf_config.config_from_hf(no_head_dim).head_dim == 128
  assert hf_config.config_from_hf({**QWEN3, "attention_bias": True}).out_bias
  # Sliding windows follow the Qwen2 rule.
  config = hf_config.config_from_hf({**QWEN3, "use_sliding_window": True, "sliding_window": 1024,
                              "max_window_layers": 1, "max_position_embeddings": 4096})
  assert config.sliding_window == 1024 and config.local_layers == (False, True)
  assert hf_config.config_from_hf({**QWEN3, "use_sliding_window": False,
                            "sliding_window": 1024}).sliding_window is None
  # Qwen3 always normalises q and k; a config saying otherwise is refused.
  assert hf_config.config_from_hf({**QWEN3, "use_qk_norm": True}).qk_norm
  with pytest.raises(ValueError, match="use_qk_norm=False"):
    hf_config.config_from_hf({**QWEN3, "use_qk_norm": False})
  with pytest.raises(ValueError, match="use_qk_norm=True"):
    hf_config.config_from_hf(_config(use_qk_norm=True))


@pytest.mark.parametrize("changes,match", [
    (dict(architecture="llama", qk_norm=True), "qk_norm=True with architecture='llama'"),
    (dict(architecture="qwen3"), "qk_norm=False with architecture='qwen3'"),
    (dict(architecture="qwen3", qk_norm=True, qkv_bias=True), "qkv_bias=True != out_bias"),
    (dict(architecture="mistral", qkv_bias=True, out_bias=True), "no attention biases"),
])
def test_export_refuses_what_transformers_cannot_express(tmp_path, changes, match):
  config = TransformerConfig(vocab_size=40, embed_dim=32, num_layers=1, num_heads=4,
                             num_kv_heads=2, head_dim=8, mlp_dim=48, **changes)
  with pytest.raises(ValueError, match=match):
    hf.save_pretrained(init_model(config), tmp_path)


def test_score_head_needs_one_label():
  with pytest.raises(ValueError, match="num_labels=2"):
    hf_config.config_from_hf(_config(architectures=["LlamaForSequenceClassification"],
                              num_labels=2))


def test_unknown_field_and_dropout_warn():
  with pytest.warns(UserWarning, match="frobnicate"):
    hf_config.config_from_hf(_config(frobnicate=3))
  with pytest.warns(UserWarning, match="attention_dropout"):
    hf_config.config_from_hf(_config(attention_dropout=0.1))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    hf_config.config_from_hf(_config(transformers_version="4.44.0", use_cache=True))


def test_export_refuses_unrepresentable_bias(tmp_path):
  config = TransformerConfig(vocab_size=40, embed_dim=32, num_layers=1, num_heads=4,
                             num_kv_heads=2, head_dim=8, mlp_dim=48, qkv_bias=True)
  with pytest.raises(ValueError, match="qkv_bias=True != out_bias=False"):
    hf.save_pretrained(init_model(config), tmp_path)


def test_missing_weights_file(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(BASE))
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    hf.from_pretrained(tmp_path)
