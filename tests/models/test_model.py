"""Model behaviour: KV-cache decoding equals the full pass, padding is invisible, heads."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipe_rlhf_jax.models import (
  KVCache,
  TransformerConfig,
  default_positions,
  init_model,
  param_axes,
  tiny_config,
)

SMALL = dict(vocab_size=64, embed_dim=32, num_layers=3, num_heads=4, num_kv_heads=2,
             head_dim=8, mlp_dim=48)


def _tokens(batch, length, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 64, (batch, length)), jnp.int32)


def test_cached_prefill_and_decode_equal_full_forward():
  config = tiny_config(**SMALL)
  model = init_model(config)
  tokens = _tokens(2, 9)
  mask = jnp.ones((2, 9), bool).at[0, :3].set(False)
  full = model(tokens, mask)
  positions = default_positions(mask)
  cache = KVCache.zeros(config, 2, 9)
  out, cache = model.forward_cached(tokens[:, :5], positions[:, :5], mask, cache, 0)
  outs = [out]
  for t in range(5, 9):
    out, cache = model.forward_cached(tokens[:, t:t + 1], positions[:, t:t + 1], mask, cache, t)
    outs.append(out)
  stepped = jnp.concatenate(outs, axis=1)
  np.testing.assert_allclose(stepped[1], full[1], atol=1e-5)
  np.testing.assert_allclose(stepped[0, 3:], full[0, 3:], atol=1e-5)


def test_left_padding_does_not_change_real_positions():
  model = init_model(tiny_config(**SMALL))
  tokens = _tokens(1, 6)
  alone = model(tokens)
  padded = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), tokens], axis=1)
  mask = jnp.arange(9)[None] >= 3
  out = model(padded, mask)
  assert np.all(np.isfinite(np.asarray(out)))
  np.testing.assert_allclose(out[:, 3:], alone, atol=1e-5)


@pytest.mark.parametrize("head,shape", [("lm", (2, 7, 64)), ("value", (2, 7)),
                                        ("score", (2, 7))])
def test_heads(head, shape):
  model = init_model(tiny_config(**SMALL, head=head))
  out = model(_tokens(2, 7))
  assert out.shape == shape and out.dtype == jnp.float32


def test_tied_embeddings_and_qkv_bias_have_expected_params():
  model = init_model(tiny_config(**SMALL, tie_embeddings=True, qkv_bias=True))
  assert model.lm_head is None
  assert model.layers.q_bias.get_value().shape == (3, 4, 8)
  state = nnx.state(model, nnx.Param)
  n = sum(x.size for x in jax.tree.leaves(state))
  assert n == model.config.num_params()


def test_every_param_has_logical_axes_matching_its_rank():
  model = init_model(tiny_config(**SMALL))
  state = nnx.state(model, nnx.Param)
  axes = param_axes(model)
  flat_state = jax.tree.leaves(state)
  flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
  assert len(flat_state) == len(flat_axes)
  for value, names in zip(flat_state, flat_axes):
    assert len(names) == value.ndim
  assert model.layers.q_proj.get_metadata()["axes"][0] == "layers"


def test_bf16_compute_stays_close_to_f32():
  config = tiny_config(**SMALL)
  model = init_model(config)
  bf16 = init_model(config.replace(dtype="bfloat16"))
  tokens = _tokens(2, 5)
  ref, out = model(tokens), bf16(tokens)
  assert out.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(ref - out))) < 0.05


def test_bad_config_names_the_field():
  with pytest.raises(ValueError, match="num_kv_heads"):
    TransformerConfig(**{**SMALL, "num_kv_heads": 3})
  with pytest.raises(ValueError, match="rope_type='yarn'"):
    tiny_config(**SMALL, rope_scaling={"rope_type": "yarn", "factor": 2.0})
