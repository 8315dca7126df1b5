"""Per-head q/k RMSNorm (Qwen3) in every path: the full pass, the KV cache, blockwise
attention with remat, tensor-sharded and pipelined decoding.

The norm weights are drawn away from their all-ones init, so a path that skipped the
norm or applied it after RoPE would change the numbers.
"""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipe_rlhf_jax.generation.pipelined import pipelined_generate
from pipe_rlhf_jax.generation.sampler import generate
from pipe_rlhf_jax.models import KVCache, default_positions, init_model, param_axes, tiny_config
from pipe_rlhf_jax.models.transformer import apply_rope, rms_norm, rope_tables, with_execution
from pipe_rlhf_jax.parallel.logical import DEFAULT_RULES, axis_rules, tree_shardings
from pipe_rlhf_jax.parallel.mesh import MeshShape, make_mesh

VOCAB = 64
# head_dim 16 with 32 wide embeddings and 4 heads: head_dim != embed / heads, as Qwen3.
SHAPE = dict(vocab_size=VOCAB, embed_dim=32, num_layers=4, num_heads=4, num_kv_heads=2,
             head_dim=16, mlp_dim=64, qk_norm=True)


def _model(seed=0, **changes):
  model = init_model(tiny_config(**{**SHAPE, **changes}), seed=seed)
  rng = np.random.default_rng(seed + 10)
  for name in ("q_norm", "k_norm"):
    param = getattr(model.layers, name)
    value = param.get_value()
    param.set_value(jnp.asarray(1.0 + 0.5 * rng.normal(size=value.shape), value.dtype))
  return model


def _batch(batch=4, length=9, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, VOCAB, size=(batch, length)).astype(np.int32)
  pads = rng.integers(0, length - 1, size=batch)
  pads[0] = 0
  mask = np.arange(length)[None] >= pads[:, None]
  return jnp.asarray(tokens), jnp.asarray(mask)


@pytest.fixture(scope="module")
def model():
  return _model()


def test_params_axes_and_counts():
  model = init_model(tiny_config(**SHAPE))
  assert model.layers.q_norm.get_value().shape == (4, 16)
  assert model.layers.k_norm.get_metadata()["axes"] == ("layers", "head_dim")
  np.testing.assert_array_equal(np.asarray(model.layers.q_norm.get_value()), 1.0)
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert sum(x.size for x in leaves) == model.config.num_params()
  assert sum(model.config.num_param_arrays()) == len(leaves)
  axes = jax.tree.leaves(param_axes(model), is_leaf=lambda x: isinstance(x, tuple))
  assert [len(a) for a in axes] == [x.ndim for x in leaves]
  plain = init_model(tiny_config(**{**SHAPE, "qk_norm": False}))
  assert not hasattr(plain.layers, "q_norm")
  assert model.config.num_params() - plain.config.num_params() == 2 * 4 * 16


def test_norm_is_applied_per_head_before_rope(model):
  """The first layer's keys in the cache equal norm-then-rotate of the projection."""
  c = model.config
  tokens, mask = _batch()
  positions = default_positions(mask)
  _, cache = model.forward_cached(tokens, positions, mask, KVCache.zeros(c, 4, 9), 0)
  p = {n: getattr(model.layers, n).get_value()[0] for n in ("attn_norm", "k_proj", "k_norm")}
  x = rms_norm(model.embed(tokens), p["attn_norm"], c.norm_eps)
  k = jnp.einsum("ble,ekd->blkd", x, p["k_proj"])
  cos, sin = rope_tables(c, positions)
  want = apply_rope(rms_norm(k, p["k_norm"], c.norm_eps), cos, sin)
  # The cache is head-major: [batch, kv_heads, slots, head_dim].
  np.testing.assert_allclose(np.asarray(cache.k[0]).swapaxes(1, 2), np.asarray(want),
                             atol=1e-5)
  rotate_first = rms_norm(apply_rope(k, cos, sin), p["k_norm"], c.norm_eps)
  assert float(jnp.max(jnp.abs(rotate_first - want))) > 1e-2  # the order matters here


def test_cached_decode_equals_full_forward(model):
  tokens, mask = _batch()
  full = model(tokens, mask)
  positions = default_positions(mask)
  cache = KVCache.zeros(model.config, 4, 9)
  out, cache = model.forward_cached(tokens[:, :5], positions[:, :5], mask, cache, 0)
  outs = [out]
  for t in range(5, 9):
    out, cache = model.forward_cached(tokens[:, t:t + 1], positions[:, t:t + 1], mask,
                                      cache, t)
    outs.append(out)
  stepped = jnp.concatenate(outs, axis=1)
  real = np.asarray(mask)
  np.testing.assert_allclose(np.asarray(stepped)[real], np.asarray(full)[real], atol=1e-5)


# Blockwise attention alone in the slow tier: the second case runs it with remat.
@pytest.mark.parametrize("changes", [pytest.param(dict(attention="blockwise",
                                                       attention_block_size=4),
                                                  marks=pytest.mark.slow),
                                     dict(attention="blockwise", attention_block_size=3,
                                          remat="full"),
                                     dict(remat="save_matmuls", scan_unroll=2)])
def test_blockwise_and_remat_equal_dense_with_gradients(model, changes):
  tokens, mask = _batch(seed=1)
  graphdef, params = nnx.split(model)
  other = with_execution(graphdef, params, **changes)

  def loss(graphdef, params):
    logits = nnx.merge(graphdef, params)(tokens, mask)
    return jnp.sum(jnp.where(mask[..., None], jax.nn.log_softmax(logits), 0.0))

  want_loss, want = jax.value_and_grad(loss, argnums=1)(graphdef, params)
  got_loss, got = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)(
      other, params)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
  assert float(jnp.abs(want["layers"]["q_norm"].get_value()).max()) > 0  # trained too


def _prompts():
  rs = np.random.RandomState(1)
  lengths = [6, 3, 5, 6, 1, 4, 6, 2]
  prompt = np.zeros((8, 6), np.int32)
  mask = np.zeros((8, 6), bool)
  for row, n in enumerate(lengths):
    prompt[row, 6 - n:] = rs.randint(1, VOCAB, n)
    mask[row, 6 - n:] = True
  return prompt, mask


SAMPLED = dict(temperature=0.8, top_k=20, top_p=0.95)


@pytest.fixture(scope="module")
def decoded(model):
  prompt, mask = _prompts()
  ids = np.arange(8, dtype=np.int32)
  want = generate(model, prompt, mask, 5, rng=jax.random.key(3), eos_id=None,
                  sample_ids=ids, **SAMPLED)
  return prompt, mask, ids, want


def _assert_same(got, want):
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(got.mask, want.mask)


def test_tensor_sharded_decoding_equals_one_device(model, decoded):
  prompt, mask, ids, want = decoded
  mesh = make_mesh(MeshShape(tensor=2), jax.devices()[:2])
  graphdef, state = nnx.split(model)
  state = jax.device_put(state, tree_shardings(mesh, param_axes(model), DEFAULT_RULES))
  with axis_rules(mesh, DEFAULT_RULES):
    got = generate(nnx.merge(graphdef, state), prompt, mask, 5, rng=jax.random.key(3),
                   eos_id=None, sample_ids=ids, **SAMPLED)
  _assert_same(got, want)


def test_pipelined_decoding_equals_the_plain_sampler(model, decoded):
  prompt, mask, ids, want = decoded
  mesh = make_mesh(MeshShape(pipeline=2), jax.devices()[:2])
  got, _ = pipelined_generate(model, prompt, mask, 5, mesh=mesh, num_microbatches=2,
                              rng=jax.random.key(3), eos_id=None, sample_ids=ids,
                              **SAMPLED)
  _assert_same(got, want)
