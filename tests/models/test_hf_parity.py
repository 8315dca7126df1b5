"""Numerical parity of models/hf.py against transformers (CPU torch, tiny random models).

Every reference model is built here from a config with a fixed torch seed and saved to
tmp_path; nothing is downloaded. Forward passes compare f32 logits at real (non-pad)
positions of a left-padded batch.
"""

import json
import shutil

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pipe_rlhf_jax.models import hf, hf_config  # noqa: E402
from pipe_rlhf_jax.models.config import TransformerConfig  # noqa: E402
from pipe_rlhf_jax.models.transformer import init_model  # noqa: E402

torch.set_num_threads(1)

VOCAB, PAD, BOS, EOS = 97, 0, 1, 2
TOL = 1e-4
PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _hf_config(arch, **overrides):
  common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                rms_norm_eps=1e-6, max_position_embeddings=64, pad_token_id=PAD,
                bos_token_id=BOS, eos_token_id=EOS)
  common.update(overrides)
  return getattr(transformers, PREFIX[arch] + "Config")(**common)


def _hf_model(arch, head="lm", seed=0, **overrides):
  """A randomly initialised HF model whose every parameter (norms, biases too) is random."""
  torch.manual_seed(seed)
  prefix = PREFIX[arch]
  suffix = "ForCausalLM" if head == "lm" else "ForSequenceClassification"
  if head != "lm":
    overrides.setdefault("num_labels", 1)
  config = _hf_config(arch, **overrides)
  model = getattr(transformers, prefix + suffix)._from_config(
      config, attn_implementation="eager")
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.1 * torch.randn_like(p))
      else:
        p.copy_(0.08 * torch.randn_like(p))
  return model.eval()


def _batch(seed=0, batch=3, length=9, pads=(0, 3, 5)):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(3, VOCAB, size=(batch, length))
  mask = np.ones((batch, length), bool)
  for row, pad in enumerate(pads[:batch]):
    tokens[row, :pad] = PAD
    mask[row, :pad] = False
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
  return tokens, mask, positions


def _torch_out(model, tokens, mask, positions):
  with torch.no_grad():
    return model(torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                 position_ids=torch.tensor(positions)).logits.float().numpy()


def _ours(model, tokens, mask):
  return np.asarray(model(jnp.asarray(tokens), jnp.asarray(mask)))


def _max_diff_real(ours, ref, mask):
  return float(np.abs(ours - ref)[mask].max())


def _params(model):
  return {"/".join(map(str, path)): np.asarray(var.get_value())
          for path, var in nnx.iter_graph(model) if isinstance(var, nnx.Param)}


def _check_causal_parity(tmp_path, hf_model):
  hf_model.save_pretrained(tmp_path)
  ours = hf.from_pretrained(tmp_path)
  tokens, mask, positions = _batch()
  ref = _torch_out(hf_model, tokens, mask, positions)
  out = _ours(ours, tokens, mask)
  assert out.shape == ref.shape
  diff = _max_diff_real(out, ref, mask)
  assert diff <= TOL, diff
  return ours, diff


def test_llama_gqa_llama3_rope_untied(tmp_path):
  model = _hf_model("llama", rope_scaling=dict(LLAMA3_ROPE), rope_theta=10000.0)
  ours, _ = _check_causal_parity(tmp_path, model)
  c = ours.config
  assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, 16)
  assert c.rope_scaling["rope_type"] == "llama3" and not c.tie_embeddings
  assert ours.lm_head is not None
  # The scaling is live in this regime: dropping it moves the logits far beyond TOL.
  plain = hf.from_pretrained(tmp_path)
  plain.config = plain.layers.config = c.replace(rope_scaling=None)
  tokens, mask, _ = _batch()
  assert _max_diff_real(_ours(plain, tokens, mask), _ours(ours, tokens, mask), mask) > 1e-3


def test_llama_tied_embeddings(tmp_path):
  model = _hf_model("llama", tie_word_embeddings=True)
  ours, _ = _check_causal_parity(tmp_path, model)
  assert ours.config.tie_embeddings and ours.lm_head is None


def test_llama_attention_bias(tmp_path):
  ours, _ = _check_causal_parity(tmp_path, _hf_model("llama", attention_bias=True))
  assert ours.config.qkv_bias and ours.config.out_bias


@pytest.mark.parametrize("tie", [False, True])
def test_qwen2_qkv_bias(tmp_path, tie):
  model = _hf_model("qwen2", tie_word_embeddings=tie, rope_theta=1e6)
  ours, _ = _check_causal_parity(tmp_path, model)
  assert ours.config.qkv_bias and not ours.config.out_bias
  assert ours.config.architecture == "qwen2" and ours.config.tie_embeddings == tie


@pytest.mark.parametrize("tie", [False, True])
def test_qwen3_qk_norm_and_independent_head_dim(tmp_path, tie):
  # head_dim 32 != hidden 64 / 4 heads, GQA 4 / 2, random q/k norm weights.
  model = _hf_model("qwen3", head_dim=32, tie_word_embeddings=tie, rope_theta=1e6)
  ours, _ = _check_causal_parity(tmp_path, model)
  c = ours.config
  assert (c.architecture, c.qk_norm, c.head_dim, c.num_kv_heads) == ("qwen3", True, 32, 2)
  assert not c.qkv_bias and c.tie_embeddings == tie
  assert ours.layers.q_norm.get_value().shape == (2, 32)


def test_qwen3_attention_bias(tmp_path):
  ours, _ = _check_causal_parity(
      tmp_path, _hf_model("qwen3", head_dim=24, attention_bias=True))
  assert ours.config.qkv_bias and ours.config.out_bias and ours.config.qk_norm


@pytest.mark.parametrize("tie", [False, True])
def test_mistral_independent_head_dim(tmp_path, tie):
  model = _hf_model("mistral", head_dim=24, tie_word_embeddings=tie, sliding_window=None,
                    rope_theta=1e6)
  ours, _ = _check_causal_parity(tmp_path, model)
  c = ours.config
  assert (c.architecture, c.head_dim, c.qk_norm, c.qkv_bias) == ("mistral", 24, False, False)
  assert c.tie_embeddings == tie


def test_mistral_window_covering_the_context(tmp_path):
  # A window as long as the context is full attention for every position: it loads.
  model = _hf_model("mistral", sliding_window=64, max_position_embeddings=64)
  ours, _ = _check_causal_parity(tmp_path, model)
  assert ours.config.head_dim == 16


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_sequence_classification_score(tmp_path, arch):
  extra = dict(mistral=dict(sliding_window=None, head_dim=24), qwen3=dict(head_dim=24))
  model = _hf_model(arch, head="score", **extra.get(arch, {}))
  model.save_pretrained(tmp_path)
  ours = hf.from_pretrained(tmp_path)
  assert ours.config.head == "score" and ours.config.pad_token_id == PAD
  # Real tokens never equal PAD, so HF pools at the last position of every row, which
  # is the last real token under left padding.
  tokens, mask, positions = _batch(seed=1)
  ref = _torch_out(model, tokens, mask, positions)  # [batch, 1]
  scores = _ours(ours, tokens, mask)  # [batch, length]
  assert scores.shape == tokens.shape
  assert float(np.abs(scores[:, -1] - ref[:, 0]).max()) <= TOL
  # A reward checkpoint reused as a critic keeps its trained head.
  critic = hf.from_pretrained(tmp_path, head="value")
  assert critic.config.head == "value"
  np.testing.assert_array_equal(_ours(critic, tokens, mask), scores)


def test_causal_lm_initialises_value_head(tmp_path):
  _hf_model("llama").save_pretrained(tmp_path)
  policy = hf.from_pretrained(tmp_path)
  critic = hf.from_pretrained(tmp_path, head="value", seed=3)
  assert critic.config.head == "value" and not hasattr(critic, "lm_head")
  p_policy, p_critic = _params(policy), _params(critic)
  backbone = [k for k in p_policy if not k.startswith("lm_head")]
  assert sorted(backbone) == sorted(k for k in p_critic if k != "scalar_head")
  for key in backbone:
    np.testing.assert_array_equal(p_policy[key], p_critic[key])
  head = p_critic["scalar_head"]
  assert head.shape == (64, 1) and np.all(np.isfinite(head)) and np.std(head) > 0
  tokens, mask, _ = _batch()
  assert _ours(critic, tokens, mask).shape == tokens.shape


def _random_ours(config: TransformerConfig, seed=0):
  model = init_model(config, seed=seed)
  key = jax.random.key(seed + 1)
  for path, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Param):
      key, sub = jax.random.split(key)
      value = var.get_value()
      scale = 0.1 if "norm" in str(path[-1]) or "bias" in str(path[-1]) else 0.08
      base = 1.0 if "norm" in str(path[-1]) else 0.0
      var.set_value((base + scale * jax.random.normal(sub, value.shape)).astype(value.dtype))
  return model


_EXPORT_CONFIGS = {
    "llama_bias_linear_rope": dict(
        architecture="llama", qkv_bias=True, out_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama_tied_llama3": dict(architecture="llama", tie_embeddings=True,
                              rope_scaling=dict(LLAMA3_ROPE), rope_theta=5e5),
    "qwen2": dict(architecture="qwen2", qkv_bias=True),
    "qwen3_untied": dict(architecture="qwen3", qk_norm=True, head_dim=24, rope_theta=1e6),
    "qwen3_tied_bias": dict(architecture="qwen3", qk_norm=True, tie_embeddings=True,
                            qkv_bias=True, out_bias=True),
    "mistral": dict(architecture="mistral", head_dim=24, rope_theta=1e6),
    "mistral_tied_llama3": dict(architecture="mistral", tie_embeddings=True,
                                rope_scaling=dict(LLAMA3_ROPE)),
}
_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}


@pytest.mark.parametrize("name", sorted(_EXPORT_CONFIGS))
def test_export_loads_in_transformers(tmp_path, name):
  config = TransformerConfig(
      vocab_size=VOCAB, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
      norm_eps=1e-6, max_position_embeddings=64, mlp_dim=96, pad_token_id=PAD,
      bos_token_id=BOS, eos_token_id=EOS, **{"head_dim": 16, **_EXPORT_CONFIGS[name]})
  ours = _random_ours(config)
  hf.save_pretrained(ours, tmp_path)
  ref_model = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  assert type(ref_model).__name__ == _CLASSES[config.architecture]
  tokens, mask, positions = _batch(seed=2)
  diff = _max_diff_real(_ours(ours, tokens, mask),
                        _torch_out(ref_model, tokens, mask, positions), mask)
  assert diff <= TOL, diff
  # Round trip: identical config and bit-identical parameters.
  back = hf.from_pretrained(tmp_path)
  assert back.config == config
  p_ours, p_back = _params(ours), _params(back)
  assert sorted(p_ours) == sorted(p_back)
  for key, value in p_ours.items():
    np.testing.assert_array_equal(value, p_back[key], err_msg=key)


def test_export_bf16(tmp_path):
  config = TransformerConfig(
      vocab_size=VOCAB, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
      head_dim=16, mlp_dim=96, norm_eps=1e-6, max_position_embeddings=64,
      rope_scaling={"rope_type": "linear", "factor": 2.0}, pad_token_id=PAD)
  ours = _random_ours(config, seed=7)
  hf.save_pretrained(ours, tmp_path, dtype="bfloat16")
  written = json.loads((tmp_path / "config.json").read_text())
  assert written["torch_dtype"] == written["dtype"] == "bfloat16"
  back = hf.from_pretrained(tmp_path, param_dtype="bfloat16")
  for key, value in _params(ours).items():
    np.testing.assert_array_equal(np.asarray(jnp.asarray(value, jnp.bfloat16)),
                                  _params(back)[key], err_msg=key)
  ref_model = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
  tokens, mask, positions = _batch(seed=4)
  diff = _max_diff_real(_ours(back, tokens, mask),
                        _torch_out(ref_model, tokens, mask, positions), mask)
  assert diff <= TOL, diff


def test_export_value_head_as_sequence_classification(tmp_path):
  config = TransformerConfig(
      vocab_size=VOCAB, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
      head_dim=16, mlp_dim=96, architecture="qwen2", qkv_bias=True, head="value",
      pad_token_id=PAD, max_position_embeddings=64)
  ours = _random_ours(config, seed=5)
  hf.save_pretrained(ours, tmp_path)
  ref_model = transformers.AutoModelForSequenceClassification.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  assert type(ref_model).__name__ == "Qwen2ForSequenceClassification"
  assert ref_model.config.num_labels == 1
  tokens, mask, positions = _batch(seed=3)
  ref = _torch_out(ref_model, tokens, mask, positions)
  values = _ours(ours, tokens, mask)
  assert float(np.abs(values[:, -1] - ref[:, 0]).max()) <= TOL
  back = hf.from_pretrained(tmp_path)
  assert back.config.head == "value"
  np.testing.assert_array_equal(_ours(back, tokens, mask), values)


def test_bf16_checkpoint(tmp_path):
  model = _hf_model("llama", rope_scaling=dict(LLAMA3_ROPE)).to(torch.bfloat16)
  model.save_pretrained(tmp_path)
  assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
  # Our raw reader agrees bit for bit with safetensors' own torch loader.
  from safetensors.torch import load_file
  raw = hf.read_safetensors(tmp_path / "model.safetensors")
  reference = load_file(tmp_path / "model.safetensors")
  assert sorted(raw) == sorted(reference)
  for key, tensor in reference.items():
    assert raw[key].dtype == np.dtype(jnp.bfloat16)
    np.testing.assert_array_equal(raw[key].astype(np.float32), tensor.float().numpy())
  # Default: f32 parameters holding the exact bf16 values; f32 compute on both sides.
  ours = hf.from_pretrained(tmp_path)
  assert ours.config.param_dtype == "float32"
  tokens, mask, positions = _batch()
  # The reference reloads the bf16 file in f32 (weights upcast exactly); `.float()` on the
  # bf16 module would keep its bf16-rounded RoPE inv_freq buffer and differ from both.
  ref_model = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
  ref = _torch_out(ref_model, tokens, mask, positions)
  diff = _max_diff_real(_ours(ours, tokens, mask), ref, mask)
  assert diff <= TOL, diff
  # bf16 storage with f32 compute gives the very same numbers.
  ours_bf16 = hf.from_pretrained(tmp_path, param_dtype="bfloat16")
  assert ours_bf16.embedding.get_value().dtype == jnp.bfloat16
  np.testing.assert_array_equal(_ours(ours_bf16, tokens, mask), _ours(ours, tokens, mask))


def _rewrite_config(src, dst, edit):
  shutil.copytree(src, dst)
  config = json.loads((src / "config.json").read_text())
  edit(config)
  (dst / "config.json").write_text(json.dumps(config))
  return dst


def test_both_rope_config_formats(tmp_path):
  model = _hf_model("llama", rope_scaling=dict(LLAMA3_ROPE), rope_theta=20000.0)
  saved = tmp_path / "v5"
  model.save_pretrained(saved)
  v5 = json.loads((saved / "config.json").read_text())
  assert "rope_parameters" in v5 and "rope_scaling" not in v5  # transformers 5.x writes

  def to_v4(config, key):
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    config["rope_scaling"] = {key: kind, **rope}

  v4 = _rewrite_config(saved, tmp_path / "v4", lambda c: to_v4(c, "rope_type"))
  v4_type = _rewrite_config(saved, tmp_path / "v4_type", lambda c: to_v4(c, "type"))
  tokens, mask, positions = _batch()
  ref = _torch_out(model, tokens, mask, positions)
  configs = []
  for path in (saved, v4, v4_type):
    ours = hf.from_pretrained(path)
    configs.append(ours.config)
    diff = _max_diff_real(_ours(ours, tokens, mask), ref, mask)
    assert diff <= TOL, (path.name, diff)
  assert configs[0] == configs[1] == configs[2]
  assert configs[0].rope_theta == 20000.0
  assert configs[0].rope_scaling == LLAMA3_ROPE
  # transformers itself reads the 4.x variant to the same RoPE.
  v4_model = transformers.AutoModelForCausalLM.from_pretrained(
      v4, attn_implementation="eager").eval()
  np.testing.assert_array_equal(_torch_out(v4_model, tokens, mask, positions), ref)


def test_sharded_checkpoint(tmp_path):
  model = _hf_model("qwen2")
  model.save_pretrained(tmp_path / "single")
  tensors = hf.read_safetensors(tmp_path / "single" / "model.safetensors")
  sharded = tmp_path / "sharded"
  sharded.mkdir()
  shutil.copy(tmp_path / "single" / "config.json", sharded / "config.json")
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2]}
  weight_map = {}
  for shard, members in shards.items():
    hf.write_safetensors(sharded / shard, {k: tensors[k] for k in members})
    weight_map.update({k: shard for k in members})
  (sharded / "model.safetensors.index.json").write_text(
      json.dumps({"metadata": {}, "weight_map": weight_map}))
  a, b = hf.from_pretrained(tmp_path / "single"), hf.from_pretrained(sharded)
  for key, value in _params(a).items():
    np.testing.assert_array_equal(value, _params(b)[key])
  # Files from our writer load in the reference safetensors implementation too.
  from safetensors.numpy import load_file
  first = load_file(sharded / "model-00001-of-00002.safetensors")
  for key in shards["model-00001-of-00002.safetensors"]:
    np.testing.assert_array_equal(first[key], tensors[key])


def test_config_eos_list_and_defaults():
  config = hf_config.config_from_hf({
      "architectures": ["LlamaForCausalLM"], "vocab_size": 50, "hidden_size": 32,
      "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
      "eos_token_id": [7, 9], "rope_theta": 1000.0})
  assert config.eos_token_id == 7
  assert hf_config.hf_eos_token_ids({"eos_token_id": [7, 9]}) == (7, 9)
  assert (config.num_kv_heads, config.head_dim) == (4, 8)
  assert config.rope_theta == 1000.0 and config.rope_scaling is None
  assert (config.dtype, config.param_dtype) == ("float32", "float32")
  lin = hf_config.config_from_hf({
      "architectures": ["Qwen2ForCausalLM"], "vocab_size": 50, "hidden_size": 32,
      "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
      "rope_scaling": {"type": "linear", "factor": 2}}, dtype="bfloat16")
  assert lin.rope_scaling == {"rope_type": "linear", "factor": 2.0}
  assert (lin.dtype, lin.param_dtype, lin.qkv_bias) == ("bfloat16", "bfloat16", True)
