"""The continuous-batching engine (generation/engine.py) equals the static sampler."""

from flax import nnx
import jax
import numpy as np
import pytest

from pipe_rlhf_jax.generation import engine
from pipe_rlhf_jax.generation.sampler import SamplingParams, generate
from pipe_rlhf_jax.models.config import tiny_config
from pipe_rlhf_jax.models.transformer import init_model, param_axes
from pipe_rlhf_jax.parallel.logical import DEFAULT_RULES, axis_rules, tree_shardings
from pipe_rlhf_jax.parallel.mesh import MeshShape, make_mesh

VOCAB = 64
T = 12
SAMPLED = dict(temperature=0.8, top_k=16, top_p=0.95)
GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def model():
  config = tiny_config(vocab_size=VOCAB, embed_dim=32, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp_dim=64)
  return init_model(config, seed=7)


def queue(num_prompts, width=6, seed=0):
  """Left-padded prompts of varied lengths, and forced, long-tailed length budgets."""
  rs = np.random.RandomState(seed)
  tokens = np.zeros((num_prompts, width), np.int32)
  mask = np.zeros((num_prompts, width), bool)
  for row in range(num_prompts):
    n = rs.randint(1, width + 1)
    tokens[row, width - n:] = rs.randint(1, VOCAB, n)
    mask[row, width - n:] = True
  return tokens, mask


def static_reference(model, tokens, mask, n, limits, eos_id, rng, **sampling):
  """The static sampler over the whole queue at once, rows repeated per sample."""
  return generate(model, np.repeat(tokens, n, 0), np.repeat(mask, n, 0), T, rng=rng,
                  eos_id=eos_id, limits=limits, **sampling)


def assert_same(out, ref, exact=True):
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
  np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(ref.mask))
  if exact:
    np.testing.assert_array_equal(np.asarray(out.logprobs), np.asarray(ref.logprobs))
  else:
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs),
                               atol=2e-5)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("n", [1, 2])
def test_every_completion_equals_the_static_samplers(model, sampling, n):
  # 10 prompts through 4 slots with forced lengths 1..T: slots free at different steps
  # and are refilled many times; a freed slot's cache starts as NaN.
  tokens, mask = queue(10)
  rs = np.random.RandomState(1)
  limits = rs.choice([1, 2, 3, 12, 5, 12, 7], size=10 * n).astype(np.int32)
  rng = jax.random.key(3)
  params = SamplingParams(max_new_tokens=T, eos_id=None, **sampling)
  out, stats = engine.generate_continuous(model, tokens, mask, params, rng=rng,
                                          num_slots=4, group_size=n, limits=limits,
                                          cache_fill=float("nan"))
  ref = static_reference(model, tokens, mask, n, limits, None, rng, **sampling)
  assert_same(out, ref, exact=False)
  np.testing.assert_array_equal(np.asarray(out.mask).sum(1), limits)
  # Every produced token after the first came from a decode step of a busy slot.
  assert int(stats.busy_slot_steps) == int(limits.sum()) - 10 * n
  assert int(stats.busy_slot_steps) <= int(stats.decode_steps) * 4


def test_eos_frees_the_slot_and_pads_like_the_static_sampler(model):
  tokens, mask = queue(6, seed=2)
  rng = jax.random.key(0)
  # A frequent token as EOS, so that rows end early at their own steps.
  probe = generate(model, tokens, mask, T, rng=rng, eos_id=None, **SAMPLED)
  eos = int(np.bincount(np.asarray(probe.tokens).ravel(), minlength=VOCAB).argmax())
  params = SamplingParams(max_new_tokens=T, eos_id=eos, pad_id=0, **SAMPLED)
  out, stats = engine.generate_continuous(model, tokens, mask, params, rng=rng,
                                          num_slots=2)
  ref = generate(model, tokens, mask, T, rng=rng, eos_id=eos, pad_id=0, **SAMPLED)
  assert_same(out, ref, exact=False)
  lengths = np.asarray(ref.mask).sum(1)
  assert lengths.min() < T  # the test exercises EOS
  assert int(stats.busy_slot_steps) == int(lengths.sum()) - 6


def test_same_slot_count_as_the_batch_is_bit_identical(model):
  tokens, mask = queue(4, seed=3)
  limits = np.array([3, 12, 1, 7], np.int32)
  rng = jax.random.key(9)
  params = SamplingParams(max_new_tokens=T, eos_id=None, **SAMPLED)
  out, _ = engine.generate_continuous(model, tokens, mask, params, rng=rng, num_slots=4,
                                      limits=limits)
  assert_same(out, static_reference(model, tokens, mask, 1, limits, None, rng, **SAMPLED))


@pytest.mark.parametrize("name", ["tensor2", pytest.param("data2_tensor2",
                                                          marks=pytest.mark.slow)])
def test_tensor_parallel_engine_equals_one_device(model, name):
  shape = {"tensor2": MeshShape(tensor=2), "data2_tensor2": MeshShape(data=2, tensor=2)}[name]
  mesh = make_mesh(shape, jax.devices()[:shape.size])
  graphdef, state = nnx.split(model)
  state = jax.device_put(state, tree_shardings(mesh, param_axes(model), DEFAULT_RULES))
  sharded = nnx.merge(graphdef, state)
  tokens, mask = queue(6, seed=4)
  limits = np.array([2, 12, 4, 1, 9, 6], np.int32)
  rng = jax.random.key(1)
  params = SamplingParams(max_new_tokens=T, eos_id=None, **SAMPLED)
  with axis_rules(mesh, DEFAULT_RULES):
    out, _ = engine.generate_continuous(sharded, tokens, mask, params, rng=rng,
                                        num_slots=4, limits=limits)
  ref = static_reference(model, tokens, mask, 1, limits, None, rng, **SAMPLED)
  assert_same(out, ref, exact=False)


def test_bad_engine_settings_name_the_field(model):
  tokens, mask = queue(2)
  params = SamplingParams(max_new_tokens=T, eos_id=None)
  with pytest.raises(ValueError, match="num_slots=2 cannot hold one group of 4"):
    engine.generate_continuous(model, tokens, mask, params, rng=jax.random.key(0),
                               num_slots=2, group_size=4)
  with pytest.raises(ValueError, match="num_slots must be a positive int"):
    engine.EngineSpec(num_slots=0)
  with pytest.raises(ValueError, match=r"limits must have shape \(2,\)"):
    engine.generate_continuous(model, tokens, mask, params, rng=jax.random.key(0),
                               num_slots=2, limits=np.ones(3, np.int32))


def test_admission_widths_are_powers_of_two_up_to_the_free_groups():
  assert engine.EngineSpec(num_slots=8, group_size=2).widths == (1, 2, 4)
  assert engine.EngineSpec(num_slots=8, group_size=1, max_admit=3).widths == (1, 2)
  assert engine.EngineSpec(num_slots=3, group_size=3).widths == (1,)


@pytest.mark.parametrize("min_admit", [1, 2])
def test_the_pure_schedule_is_the_engines(model, min_admit):
  tokens, mask = queue(9, seed=5)
  rs = np.random.RandomState(6)
  limits = rs.choice([1, 2, 3, 12, 5, 9], size=18).astype(np.int32)
  params = SamplingParams(max_new_tokens=T, eos_id=None, **SAMPLED)
  spec = engine.EngineSpec(num_slots=5, group_size=2, min_admit=min_admit)
  rng = jax.random.key(2)
  out, stats = engine.generate_continuous(model, tokens, mask, params, rng=rng, num_slots=5,
                                          group_size=2, limits=limits, min_admit=min_admit)
  assert_same(out, static_reference(model, tokens, mask, 2, limits, None, rng, **SAMPLED),
              exact=False)
  timeline = engine.simulate(limits, spec)
  assert timeline.decode_steps == int(stats.decode_steps)
  assert timeline.busy_slot_steps == int(stats.busy_slot_steps)
  assert len(timeline.prefill_widths) == int(stats.prefills)
  assert sum(timeline.prefill_widths) == int(stats.prefill_rows)
  # Every completion decodes its length - 1 tokens, one per step, in one slot.
  for k, length in enumerate(limits):
    assert (timeline.rows == k).sum() == length - 1
  # The static sampler over batches of 4 rows waits on each batch's longest row.
  static = engine.static_timeline(limits, 4)
  assert static.decode_steps == sum(int(limits[i:i + 4].max()) - 1 for i in range(0, 18, 4))
  assert static.busy_slot_steps == timeline.busy_slot_steps
  assert static.occupancy < timeline.occupancy


def test_static_timeline_is_the_static_samplers_steps(model):
  tokens, mask = queue(8, seed=8)
  limits = np.array([1, 4, 12, 2, 3, 3, 1, 5], np.int32)
  params = dict(rng=jax.random.key(0), eos_id=None, **SAMPLED)
  steps = [int(generate(model, tokens[i:i + 4], mask[i:i + 4], T, limits=limits[i:i + 4],
                        **params).num_steps) - 1 for i in (0, 4)]
  assert engine.static_decode_steps(limits, 4) == sum(steps)


def test_admissions_wait_for_a_quarter_of_the_widest_by_default():
  assert engine.EngineSpec(num_slots=16).floor == 4
  assert engine.EngineSpec(num_slots=4, group_size=2).floor == 1
  assert engine.EngineSpec(num_slots=16, min_admit=2).floor == 2
  with pytest.raises(ValueError, match=r"min_admit must be an int in \[1, 2\]"):
    engine.EngineSpec(num_slots=4, group_size=2, min_admit=3)
