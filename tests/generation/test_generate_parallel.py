"""The plain sampler under data / fsdp / tensor parallelism equals one device (8 CPUs)."""

from contextlib import nullcontext

from flax import nnx
import jax
import numpy as np
import pytest

from pipe_rlhf_jax.generation.sampler import generate
from pipe_rlhf_jax.models.config import tiny_config
from pipe_rlhf_jax.models.transformer import init_model, param_axes
from pipe_rlhf_jax.parallel.logical import DEFAULT_RULES, axis_rules, tree_shardings
from pipe_rlhf_jax.parallel.mesh import MeshShape, make_mesh

VOCAB = 64
SAMPLED = dict(temperature=0.8, top_k=16, top_p=0.95)
MESHES = {
    "data8": MeshShape(data=8),
    "fsdp2_tensor2_data2": MeshShape(data=2, fsdp=2, tensor=2),
    "tensor2": MeshShape(tensor=2),
    "fsdp4": MeshShape(fsdp=4),
}


@pytest.fixture(scope="module")
def setup():
  config = tiny_config(vocab_size=VOCAB, embed_dim=32, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp_dim=64)
  model = init_model(config, seed=5)
  rs = np.random.RandomState(0)
  lengths = [6, 2, 5, 6, 3, 4, 6, 1]
  prompt = np.zeros((8, 6), np.int32)
  mask = np.zeros((8, 6), bool)
  for row, n in enumerate(lengths):
    prompt[row, 6 - n:] = rs.randint(1, VOCAB, n)
    mask[row, 6 - n:] = True
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda s, t, m: nnx.merge(graphdef, s)(t, m))
  ref = dict(
      logits=forward(state, prompt, mask),
      greedy=generate(model, prompt, mask, 5, rng=jax.random.key(0), temperature=0.0,
                      eos_id=None),
      sampled=generate(model, prompt, mask, 5, rng=jax.random.key(4), eos_id=None,
                       **SAMPLED),
  )
  return model, prompt, mask, ref


# data=8 and fsdp=4 alone are in the slow tier: the combined mesh covers both axes.
@pytest.mark.parametrize("name", [
    # The default run keeps the mesh that shards over every axis at once.
    pytest.param(name, marks=[] if name == "fsdp2_tensor2_data2" else [pytest.mark.slow])
    for name in MESHES])
def test_sharded_matches_single_device(setup, name):
  model, prompt, mask, ref = setup
  shape = MESHES[name]
  mesh = make_mesh(shape, jax.devices()[:shape.size])
  graphdef, state = nnx.split(model)
  state = jax.device_put(state, tree_shardings(mesh, param_axes(model), DEFAULT_RULES))
  sharded = nnx.merge(graphdef, state)
  if shape.tensor > 1:  # the params really are split
    assert not sharded.layers.q_proj.get_value().sharding.is_fully_replicated

  with axis_rules(mesh, DEFAULT_RULES):
    forward = jax.jit(lambda s, t, m: nnx.merge(graphdef, s)(t, m))
    logits = forward(state, prompt, mask)
    greedy = generate(sharded, prompt, mask, 5, rng=jax.random.key(0), temperature=0.0,
                      eos_id=None)
    sampled = generate(sharded, prompt, mask, 5, rng=jax.random.key(4), eos_id=None,
                       **SAMPLED)
  np.testing.assert_allclose(logits, ref["logits"], atol=1e-5, rtol=0)
  for got, want in ((greedy, ref["greedy"]), (sampled, ref["sampled"])):
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(got.mask, want.mask)
  if shape.data * shape.fsdp > 1:  # activations were constrained onto the batch axes
    assert not greedy.tokens.sharding.is_fully_replicated


def test_a_group_prefilled_once_splits_over_more_shards_than_prompts(setup):
  # 2 prompts x 4 samples on data=4: the once-per-prompt prefill has 2 rows for 4
  # shards (laid out by the compiler), and the result equals one device's.
  from pipe_rlhf_jax.generation import sampler
  model, prompt, mask, _ = setup
  prompt, mask = np.repeat(prompt[:2], 4, 0), np.repeat(mask[:2], 4, 0)
  ids = np.arange(8, dtype=np.int32)
  params = sampler.SamplingSettings(max_new_tokens=4, eos_id=None, **SAMPLED)
  graphdef, state = nnx.split(model)

  def run(state, mesh=None, group_size=4):
    prefill, decode = sampler.make_generate_fns(graphdef, params, group_size=group_size)
    rng = jax.random.key(3)
    with axis_rules(mesh, DEFAULT_RULES) if mesh is not None else nullcontext():
      first = prefill(state, prompt, mask, rng, ids)
      return decode(state, first, mask, rng, ids).output()

  want = run(state, group_size=1)
  mesh = make_mesh(MeshShape(data=4), jax.devices()[:4])
  sharded = jax.device_put(state, tree_shardings(mesh, param_axes(model), DEFAULT_RULES))
  got = run(sharded, mesh)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs),
                             rtol=1e-5, atol=1e-5)
