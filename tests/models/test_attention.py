"""Attention implementations and per-layer remat agree with the dense, unrematerialised model."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipe_rlhf_jax.generation.sampler import generate
from pipe_rlhf_jax.models import attention as attention_lib
from pipe_rlhf_jax.models import init_model, tiny_config
from pipe_rlhf_jax.models.transformer import with_execution
from pipe_rlhf_jax.stages.common import completion_logprobs


def _left_padded_mask(rng, batch, length):
  lengths = rng.integers(1, length + 1, size=batch)
  lengths[0] = length
  return np.arange(length)[None, :] >= (length - lengths)[:, None]


@pytest.mark.parametrize("impl,block", [("blockwise", 3), ("blockwise", 8),
                                        ("blockwise", 64), ("dot_product", 0)])
def test_attention_impls_equal_dense_on_every_row_that_sees_a_key(impl, block):
  rng = np.random.default_rng(0)
  batch, length, kv, groups, d = 3, 11, 2, 3, 8
  q = jnp.asarray(rng.normal(size=(batch, length, kv, groups, d)), jnp.float32)
  # Head-major keys and values, as the cache keeps them.
  k = jnp.asarray(rng.normal(size=(batch, kv, length, d)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(batch, kv, length, d)), jnp.float32)
  key_mask = _left_padded_mask(rng, batch, length)
  allowed = jnp.asarray(np.tril(np.ones((length, length), bool))[None] & key_mask[:, None])
  want = attention_lib.attention(q, k, v, allowed, impl="dense")
  got = attention_lib.attention(q, k, v, allowed, impl=impl, block_size=block or 512)
  rows = np.asarray(allowed.any(-1))  # [batch, length]
  np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(want)[rows], atol=2e-6)
  assert np.isfinite(np.asarray(got)).all()


def test_auto_is_dense_within_one_block_and_blockwise_beyond():
  assert attention_lib.resolve("auto", 512, 512) == "dense"
  assert attention_lib.resolve("auto", 513, 512) == "blockwise"
  assert attention_lib.resolve("dot_product", 8, 512) == "dot_product"
  # A decode step (one query) or a short prefill chunk over a long cache stays dense:
  # its scores are smaller than one block's.
  assert attention_lib.resolve("auto", 4096, 512, num_queries=1) == "dense"
  assert attention_lib.resolve("auto", 576, 512, num_queries=64) == "dense"
  assert attention_lib.resolve("auto", 576, 512, num_queries=576) == "blockwise"


def _model_and_batch(**config):
  cfg = tiny_config(vocab_size=32, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, mlp_dim=64, **config)
  model = init_model(cfg, seed=1)
  rng = np.random.default_rng(1)
  mask = _left_padded_mask(rng, 4, 12)
  tokens = jnp.asarray(rng.integers(3, 32, size=(4, 12)), jnp.int32)
  return model, tokens, jnp.asarray(mask)


@pytest.mark.parametrize("changes", [dict(attention="blockwise", attention_block_size=5),
                                     dict(attention="dot_product"),
                                     dict(remat="full"), dict(remat="save_matmuls"),
                                     dict(attention="blockwise", attention_block_size=4,
                                          remat="full"),
                                     # The default unrolls every layer; 1 is the loop.
                                     dict(scan_unroll=2), dict(scan_unroll=1),
                                     dict(scan_unroll=2, remat="save_matmuls")])
def test_forward_and_gradients_equal_the_dense_model(changes):
  model, tokens, mask = _model_and_batch()
  graphdef, params = nnx.split(model)
  other = with_execution(graphdef, params, **changes)

  def loss(graphdef, params):
    logits = nnx.merge(graphdef, params)(tokens, mask)
    return jnp.sum(jnp.where(mask[..., None], jax.nn.log_softmax(logits), 0.0))

  want_loss, want_grads = jax.value_and_grad(loss, argnums=1)(graphdef, params)
  got_loss, got_grads = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)(
      other, params)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_blockwise_prefill_and_cached_decode_generate_the_same_tokens():
  model, tokens, mask = _model_and_batch()
  graphdef, params = nnx.split(model)
  blockwise = nnx.merge(with_execution(graphdef, params, attention="blockwise",
                                       attention_block_size=3), params)
  kwargs = dict(rng=jax.random.key(0), temperature=1.0, eos_id=None, pad_id=0)
  want = generate(model, tokens, mask, 6, **kwargs)
  got = generate(blockwise, tokens, mask, 6, **kwargs)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_with_execution_refuses_fields_that_change_the_model():
  model, _, _ = _model_and_batch()
  graphdef, params = nnx.split(model)
  with pytest.raises(ValueError, match="execution fields"):
    with_execution(graphdef, params, num_layers=3)
  with pytest.raises(ValueError, match="model.remat"):
    tiny_config(remat="some")
  with pytest.raises(ValueError, match="model.scan_unroll=-1 must be an integer >= 0"):
    tiny_config(scan_unroll=-1)


@pytest.mark.parametrize("chunk", [0, 1, 5, 12, 64])
def test_chunked_completion_logprobs_equal_the_full_log_softmax(chunk):
  model, tokens, mask = _model_and_batch()
  graphdef, params = nnx.split(model)
  chunked_gd = with_execution(graphdef, params, logits_chunk_size=chunk)
  prompt, completion = tokens[:, :7], tokens[:, 7:]
  prompt_mask, completion_mask = mask[:, :7], jnp.ones_like(completion, bool)

  def full(params):  # the whole [batch, length, vocab] log-softmax, then sliced
    logits = nnx.merge(graphdef, params)(tokens, jnp.concatenate(
        [prompt_mask, completion_mask], axis=1))[:, 6:-1] / 0.7
    logp = jax.nn.log_softmax(logits)
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return jnp.take_along_axis(logp, completion[..., None], axis=-1)[..., 0], ent

  def chunked(params):
    return completion_logprobs(chunked_gd, params, prompt, prompt_mask, completion,
                               completion_mask, temperature=0.7, return_entropy=True)

  (want, want_ent), (got, got_ent) = full(params), jax.jit(chunked)(params)
  np.testing.assert_allclose(got, want, atol=1e-5)
  np.testing.assert_allclose(got_ent, want_ent, atol=1e-5)
  loss = lambda f: lambda p: jnp.sum(f(p)[0])
  for g_got, g_want in zip(jax.tree.leaves(jax.grad(loss(chunked))(params)),
                           jax.tree.leaves(jax.grad(loss(full))(params))):
    np.testing.assert_allclose(g_got, g_want, rtol=1e-4, atol=1e-5)
