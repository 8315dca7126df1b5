"""The delayed inter-batch pipelined decoder equals the plain sampler (8 CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipe_rlhf_jax.generation import pipelined
from pipe_rlhf_jax.generation import schedule as sched
from pipe_rlhf_jax.generation.pipelined import pipelined_generate
from pipe_rlhf_jax.generation.sampler import SamplingSettings, generate
from pipe_rlhf_jax.models.config import tiny_config
from pipe_rlhf_jax.models.transformer import init_model
from pipe_rlhf_jax.parallel.mesh import MeshShape, make_mesh

VOCAB, BATCH, PLEN, STEPS = 64, 8, 6, 5
GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=0.8, top_k=20, top_p=0.95)
RNG_SEED = 5


def mesh_for(pipe, tensor=1):
  shape = MeshShape(pipeline=pipe, tensor=tensor)
  return make_mesh(shape, jax.devices()[:shape.size])


@pytest.fixture(scope="module")
def setup():
  config = tiny_config(vocab_size=VOCAB, embed_dim=32, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp_dim=64)
  model = init_model(config, seed=2)
  rs = np.random.RandomState(1)
  lengths = [6, 3, 5, 6, 1, 4, 6, 2]
  prompt = np.zeros((BATCH, PLEN), np.int32)
  mask = np.zeros((BATCH, PLEN), bool)
  for row, n in enumerate(lengths):
    prompt[row, PLEN - n:] = rs.randint(1, VOCAB, n)
    mask[row, PLEN - n:] = True
  ids = np.arange(100, 100 + BATCH, dtype=np.int32)  # global ids, not rows
  rng = jax.random.key(RNG_SEED)
  refs = {name: generate(model, prompt, mask, STEPS, rng=rng, eos_id=None, sample_ids=ids,
                         **kw) for name, kw in (("greedy", GREEDY), ("sampled", SAMPLED))}
  return model, prompt, mask, ids, refs


def assert_same(got, want):
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(got.mask, want.mask)
  assert int(got.num_steps) == int(want.num_steps)


CASES = [
    # (pipe, microbatches, tensor, sampling)
    (1, 1, 1, "sampled"), (1, 2, 1, "sampled"),
    # (P=2, M=2) and (P=4, M=2) run in the NaN-poisoning test below.
    (2, 1, 1, "sampled"), (2, 4, 1, "sampled"),
    (4, 1, 1, "sampled"), (4, 4, 1, "sampled"), (4, 8, 1, "sampled"),
    (2, 4, 1, "greedy"), (4, 4, 2, "greedy"),
    # Tensor-parallel stages (pipeline=1 with tensor is the tensor2 case of
    # tests/generation/test_generate_parallel.py).
    (2, 2, 2, "sampled"), (4, 8, 2, "sampled"),
]


# The default run keeps one case of each kind (M < P, M = P, M > P, greedy, tensor);
# the slow tier runs the rest.
DEFAULT_CASES = {(2, 4, 1, "sampled"), (4, 1, 1, "sampled"), (4, 4, 1, "sampled"),
                 (4, 4, 2, "greedy")}


@pytest.mark.parametrize("pipe, num_mb, tensor, sampling", [
    pytest.param(*case, id="P{}-M{}-T{}-{}".format(*case),
                 marks=[] if case in DEFAULT_CASES else [pytest.mark.slow])
    for case in CASES])
def test_matches_plain_generate(setup, pipe, num_mb, tensor, sampling):
  model, prompt, mask, ids, refs = setup
  kw = GREEDY if sampling == "greedy" else SAMPLED
  out, executed = pipelined_generate(
      model, prompt, mask, STEPS, mesh=mesh_for(pipe, tensor), num_microbatches=num_mb,
      rng=jax.random.key(RNG_SEED), eos_id=None, sample_ids=ids, **kw)
  assert_same(out, refs[sampling])
  # What actually ran is exactly the delayed schedule, tick for tick.
  np.testing.assert_array_equal(np.asarray(executed),
                                sched.delayed_schedule(pipe, num_mb, STEPS))


@pytest.mark.parametrize("pipe, num_mb, split", [(4, 2, True), (2, 2, False)])
def test_nan_poisoned_bubbles_do_not_leak(setup, pipe, num_mb, split):
  # Idle stages emit NaN activations, token -1 (a NaN embedding if ever used) and
  # "all rows done" flags, and the ring starts poisoned: results must not change.
  # split=False also covers prompt-length ring messages on every tick.
  model, prompt, mask, ids, refs = setup
  out, executed = pipelined_generate(
      model, prompt, mask, STEPS, mesh=mesh_for(pipe), num_microbatches=num_mb,
      rng=jax.random.key(RNG_SEED), eos_id=None, sample_ids=ids, poison_bubbles=True,
      split_segments=split, **SAMPLED)
  assert bool(jnp.isfinite(out.logprobs).all())
  assert_same(out, refs["sampled"])
  idle = np.asarray(executed)[..., 0] < 0
  assert idle.any()  # the poison really had bubbles to sit in
  np.testing.assert_array_equal(np.asarray(executed),
                                sched.delayed_schedule(pipe, num_mb, STEPS))


def test_eos_skips_finished_microbatches_and_exits_early(setup):
  model, prompt, mask, ids, _ = setup
  # Identical prompts decode identically under greedy, so an EOS at pass 1 finishes
  # every micro-batch after two passes and the decode loop can leave early.
  prompt, mask = np.repeat(prompt[:1], BATCH, 0), np.repeat(mask[:1], BATCH, 0)
  rng = jax.random.key(0)
  free = generate(model, prompt, mask, STEPS, rng=rng, eos_id=None, **GREEDY)
  eos = int(free.tokens[0, 1])
  first = int(np.nonzero(np.asarray(free.tokens[0]) == eos)[0][0])
  want = generate(model, prompt, mask, STEPS, rng=rng, eos_id=eos, **GREEDY)
  assert int(want.num_steps) == first + 1 < STEPS
  out, executed = pipelined_generate(
      model, prompt, mask, STEPS, mesh=mesh_for(2), num_microbatches=4, rng=rng,
      eos_id=eos, chunk_ticks=1, **GREEDY)
  assert_same(out, want)
  executed = np.asarray(executed)
  full = sched.delayed_schedule(2, 4, STEPS)
  ran = executed[..., 0] >= 0
  # Exactly passes 0..first of every micro-batch ran, on both stages.
  assert ran.sum() == 4 * 2 * (first + 1)
  assert (executed[ran][:, 1] <= first).all()
  np.testing.assert_array_equal(executed[ran], full[ran])
  # The decode loop left early: the tail of the schedule was never reached, while
  # every tick up to the last work was (chunk_ticks=1 checks after every tick).
  reached = (executed >= -1).all(axis=(1, 2))
  last_work = np.nonzero(ran.any(axis=1))[0].max()
  assert reached[:last_work + 1].all()
  assert not reached[-1] and (executed[~reached] == pipelined.NOT_REACHED).all()
  assert reached.sum() < full.shape[0]


def test_eos_with_unequal_rows_matches_plain(setup):
  model, prompt, mask, ids, refs = setup
  eos = int(refs["sampled"].tokens[3, 2])
  rng = jax.random.key(RNG_SEED)
  want = generate(model, prompt, mask, STEPS, rng=rng, eos_id=eos, sample_ids=ids,
                  pad_id=VOCAB - 1, **SAMPLED)
  assert not bool(want.mask.all())  # some rows really stopped
  out, executed = pipelined_generate(model, prompt, mask, STEPS, mesh=mesh_for(2),
                                     num_microbatches=2, rng=rng, eos_id=eos,
                                     sample_ids=ids, pad_id=VOCAB - 1, **SAMPLED)
  assert_same(out, want)
  # The planner's model of the early exit (each micro-batch runs as many passes as its
  # longest row; the loop stops at a chunk boundary) is the schedule that really ran.
  passes = np.asarray(out.mask).sum(axis=1).reshape(2, -1).max(axis=1)
  predicted = sched.early_exit_schedule(2, 2, STEPS, passes)
  executed = np.asarray(executed)
  reached = (executed >= -1).all(axis=(1, 2))
  assert reached.sum() == min(len(predicted), len(executed))
  np.testing.assert_array_equal(executed[reached], predicted[:reached.sum()])


# Continuous batching at micro-batch grain: a queue of B rows over S < B slots, each
# micro-batch refilled with the next load of S / M rows when its rows are all done.
LIMITS = np.array([5, 1, 3, 2, 5, 1, 4, 2], np.int32)  # forced, varied lengths
REFILL_CASES = [
    # (pipe, microbatches, slots, tensor, sampling)
    (2, 2, 4, 1, "sampled"),
    pytest.param(4, 2, 2, 1, "greedy", marks=pytest.mark.slow),  # mb = 1, M < P
    pytest.param(2, 2, 4, 2, "sampled", marks=pytest.mark.slow),  # tensor-parallel stages
]


@pytest.mark.parametrize("pipe, num_mb, slots, tensor, sampling", REFILL_CASES)
def test_refilled_microbatches_match_plain_generate(setup, pipe, num_mb, slots, tensor,
                                                    sampling):
  # The cache, the ring and the bubbles start poisoned with NaN: a refilled
  # micro-batch's region (and every idle slot) must not leak into a completion.
  model, prompt, mask, ids, _ = setup
  kw = GREEDY if sampling == "greedy" else SAMPLED
  rng = jax.random.key(RNG_SEED)
  want = generate(model, prompt, mask, STEPS, rng=rng, eos_id=None, sample_ids=ids,
                  limits=LIMITS, **kw)
  out, executed = pipelined_generate(
      model, prompt, mask, STEPS, mesh=mesh_for(pipe, tensor), num_microbatches=num_mb,
      num_slots=slots, limits=LIMITS, rng=rng, eos_id=None, sample_ids=ids,
      poison_bubbles=True, **kw)
  assert bool(jnp.isfinite(out.logprobs).all())
  assert_same(out, want)
  # What ran is the refill schedule of the loads' lengths, tick for tick; it ends
  # before the static schedule's length would have.
  rows = slots // num_mb
  passes = LIMITS.reshape(-1, rows).max(axis=1)
  predicted = sched.refill_schedule(pipe, num_mb, passes)
  executed = np.asarray(executed)
  reached = int((executed >= -1).all(axis=(1, 2)).sum())
  assert reached >= len(predicted)
  np.testing.assert_array_equal(executed[:len(predicted)], predicted)
  assert (executed[len(predicted):, :, 0] < 0).all()
  assert len(passes) > num_mb and (np.asarray(executed)[..., 1] == 0).sum() == (
      len(passes) * pipe)  # every load prefilled once, on every stage


@pytest.mark.parametrize("slots, match", [
    (3, r"generate\.num_slots = 3 is not a multiple of generate\.num_microbatches = 2"),
    (6, r"micro-batches of 3 rows, which do not divide the batch of 8 rows"),
    (-1, r"generate\.num_slots must be an int >= 0"),
])
def test_bad_slot_counts_raise_before_compiling(setup, no_compile, slots, match):
  model, prompt, mask, _, _ = setup
  with pytest.raises(ValueError, match=match):
    pipelined_generate(model, prompt, mask, STEPS, mesh=mesh_for(2), num_microbatches=2,
                       num_slots=slots, rng=jax.random.key(0), eos_id=None)


def test_stage_call_form_with_sampling_params(setup):
  # The generate stage calls (graphdef, state, tokens, mask, SamplingSettings).
  from flax import nnx
  model, prompt, mask, ids, refs = setup
  graphdef, state = nnx.split(model)
  params = SamplingSettings(max_new_tokens=STEPS, temperature=0.0)
  out, _ = pipelined_generate(graphdef, state, prompt, mask, params, mesh=mesh_for(2),
                              num_microbatches=4, rng=jax.random.key(RNG_SEED),
                              sample_ids=ids)
  assert_same(out, refs["greedy"])


@pytest.fixture
def no_compile(monkeypatch):
  def fail(*args, **kwargs):
    raise AssertionError("compiled before validating")
  monkeypatch.setattr(pipelined, "_build", fail)


@pytest.mark.parametrize("kwargs, match", [
    (dict(mesh_shape=MeshShape(pipeline=3)), r"generate\.mesh\.pipeline = 3 does not divide"),
    (dict(num_microbatches=0), r"generate\.num_microbatches must be an int >= 1"),
    (dict(num_microbatches=3), r"generate\.batch_size = 8 is not divisible"),
    (dict(mesh_shape=MeshShape(pipeline=2, data=2)), r"must be 1 for pipelined"),
    (dict(mesh_shape=MeshShape(pipeline=2, tensor=4)), r"kv_heads=2 is not divisible"),
])
def test_bad_configs_raise_before_compiling(setup, no_compile, kwargs, match):
  model, prompt, mask, _, _ = setup
  shape = kwargs.pop("mesh_shape", MeshShape(pipeline=2))
  kwargs.setdefault("num_microbatches", 2)
  mesh = make_mesh(shape, jax.devices()[:shape.size])
  with pytest.raises(ValueError, match=match):
    pipelined_generate(model, prompt, mask, STEPS, mesh=mesh, rng=jax.random.key(0),
                       eos_id=None, **kwargs)


def test_sampling_params_and_keywords_do_not_mix(setup, no_compile):
  model, prompt, mask, _, _ = setup
  params = SamplingSettings(max_new_tokens=STEPS, temperature=0.0)
  with pytest.raises(ValueError, match="temperature"):
    pipelined_generate(model, prompt, mask, params, mesh=mesh_for(2), num_microbatches=2,
                       rng=jax.random.key(0), temperature=0.5)


def test_mesh_without_pipe_axis_is_refused(setup, no_compile):
  model, prompt, mask, _, _ = setup
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  with pytest.raises(ValueError, match="'pipeline' axis"):
    pipelined_generate(model, prompt, mask, STEPS, mesh=mesh, num_microbatches=2,
                       rng=jax.random.key(0), eos_id=None)


def test_compiled_program_is_reused_across_calls(setup):
  # Equal static settings (model structure, plan, mesh, rules) must find the same
  # jitted program, traced and compiled once, even with new rng / prompt values.
  model, prompt, mask, ids, refs = setup
  mesh = mesh_for(2)
  kw = dict(mesh=mesh, num_microbatches=2, eos_id=None, sample_ids=ids, **SAMPLED)
  first = pipelined.prepare_pipelined(model, prompt, mask, STEPS,
                                      rng=jax.random.key(RNG_SEED), **kw)
  out, _ = first.fn(*first.args)
  assert_same(out, refs["sampled"])
  second = pipelined.prepare_pipelined(model, prompt[::-1], mask[::-1], STEPS,
                                       rng=jax.random.key(RNG_SEED + 1), **kw)
  assert second.fn is first.fn and second.plan == first.plan
  second.fn(*second.args)
  assert first.fn._cache_size() == 1  # pylint: disable=protected-access
