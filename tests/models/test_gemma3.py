"""Gemma 3 (text) against transformers: logits, greedy generation, export, config policy.

Reference models are built here from tiny configs with a fixed torch seed (every
parameter random, norms included) and saved to tmp_path; nothing is downloaded. Each
config has local (sliding-window) and global layers and a window shorter than the
sequence, so both kinds and the window itself shape the logits.
"""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pipe_rlhf_jax.generation import sampler  # noqa: E402
from pipe_rlhf_jax.models import hf, hf_config, shapes  # noqa: E402
from pipe_rlhf_jax.models.transformer import init_model  # noqa: E402

torch.set_num_threads(1)

VOCAB, PAD, EOS, BOS = 97, 0, 1, 2
TOL = 1e-4
NEW = 8
S, F = "sliding_attention", "full_attention"
LINEAR8 = {"rope_type": "linear", "factor": 8.0}

# (window, layer pattern, extra config): patterns given as `layer_types` and as
# transformers' `sliding_window_pattern` rule.
CASES = {
    "window3_explicit_linear_rope": dict(
        sliding_window=3, layer_types=[S, F, S, S], rope_scaling=dict(LINEAR8),
        rope_theta=1e4, rope_local_base_freq=100.0, query_pre_attn_scalar=20, head_dim=24),
    "window5_pattern2": dict(sliding_window=5, sliding_window_pattern=2, head_dim=16,
                             rope_theta=1e6, rope_local_base_freq=1e4),
    "window1_pattern6": dict(sliding_window=1, num_hidden_layers=6, head_dim=32,
                             num_key_value_heads=1, query_pre_attn_scalar=32),
}


def _hf_config(**overrides):
  kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                max_position_embeddings=64, pad_token_id=PAD, bos_token_id=BOS,
                eos_token_id=EOS)
  kwargs.update(overrides)
  return transformers.Gemma3TextConfig(**kwargs)


def _randomise(model, seed, scale=0.08):
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      # Gemma norms scale by 1 + w: random w around 0 keeps them near the identity.
      p.copy_((0.1 if "norm" in name else scale) * torch.randn_like(p))
  return model.eval()


def _hf_model(seed=0, scale=0.08, **overrides):
  model = transformers.Gemma3ForCausalLM._from_config(_hf_config(**overrides),
                                                      attn_implementation="eager")
  return _randomise(model, seed, scale)


def _batch(seed=0, batch=3, length=9, pads=(0, 3, 5)):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(3, VOCAB, size=(batch, length))
  mask = np.ones((batch, length), bool)
  for row, pad in enumerate(pads[:batch]):
    tokens[row, :pad] = PAD
    mask[row, :pad] = False
  return tokens, mask


def _torch_logits(model, tokens, mask):
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    return model(torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                 position_ids=torch.tensor(positions)).logits.float().numpy()


def _ours(model, tokens, mask, **execution):
  if execution:
    config = model.config.replace(**execution)
    model.config = model.layers.config = config
  return np.asarray(model(jnp.asarray(tokens), jnp.asarray(mask)))


def _diff(a, b, mask):
  return float(np.abs(a - b)[mask].max())


# The 6-layer case (Gemma 3's own pattern) in the slow tier: the two 4-layer cases keep a
# local and a global layer each in the default run.
@pytest.mark.parametrize("case", [
    pytest.param(case, marks=[pytest.mark.slow] if case == "window1_pattern6" else [])
    for case in sorted(CASES)])
def test_logits_match_transformers_in_every_attention_impl(tmp_path, case):
  model = _hf_model(**CASES[case])
  model.save_pretrained(tmp_path)
  tokens, mask = _batch()
  ref = _torch_logits(model, tokens, mask)
  expected_types = tuple(model.config.layer_types)
  assert S in expected_types and F in expected_types
  for execution in (dict(attention="dense"),
                    dict(attention="blockwise", attention_block_size=4),
                    dict(attention="dot_product")):
    ours = hf.from_pretrained(tmp_path)
    c = ours.config
    assert (c.architecture, c.layer_types, c.sliding_window) == (
        "gemma3", expected_types, model.config.sliding_window)
    out = _ours(ours, tokens, mask, **execution)
    assert _diff(out, ref, mask) <= TOL, (execution, _diff(out, ref, mask))
  # The window is live: without it the logits move far beyond the tolerance.
  ours = hf.from_pretrained(tmp_path)
  assert _diff(_ours(ours, tokens, mask, sliding_window=None), ref, mask) > 1e-3


def test_config_fields(tmp_path):
  model = _hf_model(**CASES["window3_explicit_linear_rope"])
  model.save_pretrained(tmp_path)
  c = hf.from_pretrained(tmp_path).config
  assert (c.head_dim, c.num_kv_heads, c.qk_norm, c.tie_embeddings) == (24, 2, True, True)
  assert (c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar) == (1e4, 100.0, 20.0)
  assert dict(c.rope_scaling) == LINEAR8
  assert c.local_layers == (True, False, True, True)
  assert (c.pad_token_id, c.eos_token_id, c.bos_token_id) == (PAD, EOS, BOS)
  # Four norms per layer, q/k norms, no separate LM head.
  assert {"attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "q_norm",
          "k_norm"} <= set(hf.from_pretrained(tmp_path).layers.param_names())
  assert c.num_params() == sum(p.numel() for p in model.parameters())


def _hf_greedy(model, tokens, mask, eos_id):
  with torch.no_grad():
    out = model.generate(torch.tensor(tokens),
                         attention_mask=torch.tensor(mask.astype(np.int64)),
                         do_sample=False, max_new_tokens=NEW, eos_token_id=eos_id,
                         pad_token_id=PAD, output_scores=True, return_dict_in_generate=True,
                         temperature=None, top_k=None, top_p=None)
  new = out.sequences[:, tokens.shape[1]:].numpy()
  new = np.pad(new, ((0, 0), (0, NEW - new.shape[1])), constant_values=PAD)
  return new, torch.stack(out.scores, 1).numpy()


@pytest.mark.parametrize("case", ["window3_explicit_linear_rope", "window5_pattern2"])
def test_greedy_generation_matches_hf_generate(tmp_path, case):
  model = _hf_model(scale=0.15, **CASES[case])
  model.save_pretrained(tmp_path)
  ours = hf.from_pretrained(tmp_path)
  tokens, mask = _batch(length=7, pads=(0, 2, 4))
  free_run, _ = _hf_greedy(model, tokens, mask, eos_id=None)
  eos_id = int(free_run[0, 3])  # row 0 stops early; the others run on
  expected, scores = _hf_greedy(model, tokens, mask, eos_id=eos_id)
  top2 = np.sort(scores, -1)[..., -2:]
  assert float((top2[..., 1] - top2[..., 0]).min()) > 1e-3  # argmax well posed
  out = sampler.generate(ours, jnp.asarray(tokens), jnp.asarray(mask), NEW,
                         rng=jax.random.key(0), temperature=0.0, top_k=0, top_p=1.0,
                         eos_id=eos_id, pad_id=PAD)
  np.testing.assert_array_equal(np.asarray(out.tokens), expected)
  # Prompt (7) + completion (8) spans more than the window: the decode steps use it.
  assert tokens.shape[1] + NEW > 2 * CASES[case]["sliding_window"]


def _random_gemma(config, seed=3):
  model = init_model(config, seed=seed)
  rng = np.random.default_rng(seed)
  for _, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Param):
      value = np.asarray(var.get_value())
      var.set_value(jnp.asarray(0.1 * rng.normal(size=value.shape), value.dtype))
  return model


@pytest.mark.parametrize("head", ["lm", "score"])
def test_export_loads_in_transformers_with_the_same_outputs(tmp_path, head):
  fields = _hf_config(**CASES["window3_explicit_linear_rope"]).to_dict()
  config = hf_config.config_from_hf({**fields, "architectures": ["Gemma3ForCausalLM"]}, head=head)
  ours = _random_gemma(config)
  hf.save_pretrained(ours, tmp_path)
  tokens, mask = _batch()
  if head == "lm":
    theirs = transformers.Gemma3ForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    ref = _torch_logits(theirs, tokens, mask)
    assert _diff(_ours(ours, tokens, mask), ref, mask) <= TOL
  else:
    theirs = transformers.Gemma3TextForSequenceClassification.from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
      ref = theirs(torch.tensor(tokens),
                   attention_mask=torch.tensor(mask.astype(np.int64))).logits[:, 0].numpy()
    # HF pools at the last non-pad token: the last column under left padding.
    np.testing.assert_allclose(_ours(ours, tokens, mask)[:, -1], ref, atol=TOL)
  assert tuple(theirs.config.layer_types) == (S, F, S, S)
  assert theirs.config.sliding_window == 3
  # And back: the export reloads here with the same config.
  assert hf.from_pretrained(tmp_path).config == config


def _gemma_json(**overrides):
  return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
          "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 1,
          "head_dim": 16, **overrides}


@pytest.mark.parametrize("field,value", [("attn_logit_softcapping", 50.0),
                                         ("final_logit_softcapping", 30.0),
                                         ("use_bidirectional_attention", True),
                                         ("hidden_activation", "gelu")])
def test_math_changing_fields_are_refused_by_name(field, value):
  with pytest.raises(ValueError, match=field):
    hf_config.config_from_hf(_gemma_json(**{field: value}))


def test_defaults_and_patterns_follow_transformers():
  config = hf_config.config_from_hf(_gemma_json())
  want = transformers.Gemma3TextConfig(**{k: v for k, v in _gemma_json().items()
                                          if k not in ("architectures", "model_type")})
  assert config.layer_types == tuple(want.layer_types)  # every sixth layer global
  assert config.sliding_window == want.sliding_window == 4096
  assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)
  assert config.query_pre_attn_scalar == 256 and config.tie_embeddings
  assert config.max_position_embeddings == 131072
  assert (config.pad_token_id, config.eos_token_id, config.bos_token_id) == (0, 1, 2)
  # transformers 5 reads `sliding_window_pattern`, and only records the underscored one.
  three = hf_config.config_from_hf(_gemma_json(sliding_window_pattern=3))
  assert three.local_layers == (True, True, False) * 4
  assert hf_config.config_from_hf(_gemma_json(_sliding_window_pattern=3)).layer_types == \
      config.layer_types
  # A text-only config without `architectures` is a causal LM.
  with pytest.warns(UserWarning, match="architectures"):
    bare = hf_config.config_from_hf({k: v for k, v in _gemma_json().items()
                              if k != "architectures"})
  assert bare.architecture == "gemma3" and bare.head == "lm"
  with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration"):
    hf_config.config_from_hf(_gemma_json(architectures=["Gemma3ForConditionalGeneration"]))


def test_nested_rope_parameters_of_transformers_5():
  nested = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
  config = hf_config.config_from_hf(_gemma_json(rope_parameters=nested))
  assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)
  assert dict(config.rope_scaling) == LINEAR8
  bad = {**nested, "sliding_attention": {"rope_type": "linear", "factor": 2.0}}
  with pytest.raises(ValueError, match="sliding_attention"):
    hf_config.config_from_hf(_gemma_json(rope_parameters=bad))


def test_published_270m_shape():
  fields = shapes.hf_config("gemma3-270m")
  config = shapes.config("gemma3-270m")
  want = transformers.Gemma3TextConfig(**{k: v for k, v in fields.items()
                                          if k not in ("architectures", "model_type")})
  assert config.layer_types == tuple(want.layer_types)
  assert config.local_layers.count(False) == 3  # layers 5, 11, 17 are global
  assert (config.vocab_size, config.embed_dim, config.num_layers, config.num_heads,
          config.num_kv_heads, config.head_dim, config.mlp_dim) == (
              262144, 640, 18, 4, 1, 256, 2048)
  assert (config.sliding_window, config.query_pre_attn_scalar, config.rope_theta,
          config.rope_local_theta) == (512, 256, 1e6, 1e4)
  assert config.max_position_embeddings == 32768 and config.tie_embeddings
  # About 268M parameters (170M of them in the embedding), as published.
  assert 260e6 < config.num_params() < 275e6


def test_embedding_normaliser_is_rounded_to_the_compute_dtype():
  # transformers multiplies by sqrt(hidden) cast to the weights' dtype: in bf16
  # sqrt(640) = 25.298 becomes 25.25.
  config = hf_config.config_from_hf(_gemma_json(hidden_size=640, num_hidden_layers=1),
                             dtype="bfloat16")
  model = _random_gemma(config)
  tokens = jnp.asarray([[3, 4, 5]])
  table = model.embedding.get_value()[tokens].astype(jnp.bfloat16)
  got = model.embed(tokens)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(table * jnp.bfloat16(25.25), np.float32))
  assert float(jnp.asarray(640 ** 0.5, jnp.bfloat16)) == 25.25
