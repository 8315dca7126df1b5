"""The continuous-batching engine (generation/engine.py) equals the static sampler."""

from flax import nnx
import jax
import numpy as np
import pytest

from pipe_rlhf_jax.generation import engine, slot_schedule
from pipe_rlhf_jax.generation.sampler import SamplingSettings, generate
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


# The default run keeps two of the four cases, which between them take each sampling and
# each group size; the other two are in the slow tier.
@pytest.mark.parametrize("n,sampling", [
    pytest.param(1, GREEDY, id="1-greedy"), pytest.param(2, SAMPLED, id="2-sampled"),
    pytest.param(1, SAMPLED, id="1-sampled", marks=pytest.mark.slow),
    pytest.param(2, GREEDY, id="2-greedy", marks=pytest.mark.slow)])
def test_every_completion_equals_the_static_samplers(model, sampling, n):
  # 10 prompts through 4 slots with forced lengths 1..T: slots free at different steps
  # and are refilled many times; a freed slot's cache starts as NaN.
  tokens, mask = queue(10)
  rs = np.random.RandomState(1)
  limits = rs.choice([1, 2, 3, 12, 5, 12, 7], size=10 * n).astype(np.int32)
  rng = jax.random.key(3)
  params = SamplingSettings(max_new_tokens=T, eos_id=None, **sampling)
  out, stats = engine.generate_continuous(model, tokens, mask, params, rng=rng,
                                          num_slots=4, group_size=n, limits=limits,
                                          cache_fill=float("nan"))
  ref = static_reference(model, tokens, mask, n, limits, None, rng, **sampling)
  assert_same(out, ref, exact=False)
  np.testing.assert_array_equal(np.asarray(out.mask).sum(1), limits)
  # Every produced token after the first came from a decode step of a busy slot.
  assert int(stats.busy_slot_steps) == int(limits.sum()) - 10 * n
  assert int(stats.busy_slot_steps) <= int(stats.decode_steps) * 4


# The default tier's engine case of tests/stages/test_ppo_stages.py frees slots at EOS too.
@pytest.mark.slow
def test_eos_frees_the_slot_and_pads_like_the_static_sampler(model):
  tokens, mask = queue(6, seed=2)
  rng = jax.random.key(0)
  # A frequent token as EOS, so that rows end early at their own steps.
  probe = generate(model, tokens, mask, T, rng=rng, eos_id=None, **SAMPLED)
  eos = int(np.bincount(np.asarray(probe.tokens).ravel(), minlength=VOCAB).argmax())
  params = SamplingSettings(max_new_tokens=T, eos_id=eos, pad_id=0, **SAMPLED)
  out, stats = engine.generate_continuous(model, tokens, mask, params, rng=rng,
                                          num_slots=2)
  ref = generate(model, tokens, mask, T, rng=rng, eos_id=eos, pad_id=0, **SAMPLED)
  assert_same(out, ref, exact=False)
  lengths = np.asarray(ref.mask).sum(1)
  assert lengths.min() < T  # the test exercises EOS
  assert int(stats.busy_slot_steps) == int(lengths.sum()) - 6


# Slow: the default tier holds every completion to the static sampler's (above).
@pytest.mark.slow
def test_same_slot_count_as_the_batch_is_bit_identical(model):
  tokens, mask = queue(4, seed=3)
  limits = np.array([3, 12, 1, 7], np.int32)
  rng = jax.random.key(9)
  params = SamplingSettings(max_new_tokens=T, eos_id=None, **SAMPLED)
  out, _ = engine.generate_continuous(model, tokens, mask, params, rng=rng, num_slots=4,
                                      limits=limits)
  assert_same(out, static_reference(model, tokens, mask, 1, limits, None, rng, **SAMPLED))


# Slow: the default tier's engine case of tests/stages/test_ppo_stages.py decodes on a
# tensor-parallel mesh against the one-device static stage.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["tensor2", "data2_tensor2"])
def test_tensor_parallel_engine_equals_one_device(model, name):
  shape = {"tensor2": MeshShape(tensor=2), "data2_tensor2": MeshShape(data=2, tensor=2)}[name]
  mesh = make_mesh(shape, jax.devices()[:shape.size])
  graphdef, state = nnx.split(model)
  state = jax.device_put(state, tree_shardings(mesh, param_axes(model), DEFAULT_RULES))
  sharded = nnx.merge(graphdef, state)
  tokens, mask = queue(6, seed=4)
  limits = np.array([2, 12, 4, 1, 9, 6], np.int32)
  rng = jax.random.key(1)
  params = SamplingSettings(max_new_tokens=T, eos_id=None, **SAMPLED)
  with axis_rules(mesh, DEFAULT_RULES):
    out, _ = engine.generate_continuous(sharded, tokens, mask, params, rng=rng,
                                        num_slots=4, limits=limits)
  ref = static_reference(model, tokens, mask, 1, limits, None, rng, **SAMPLED)
  assert_same(out, ref, exact=False)


def test_bad_engine_settings_name_the_field(model):
  tokens, mask = queue(2)
  params = SamplingSettings(max_new_tokens=T, eos_id=None)
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


@pytest.mark.parametrize("min_admit", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_pure_schedule_is_the_engines(model, min_admit):
  tokens, mask = queue(9, seed=5)
  rs = np.random.RandomState(6)
  limits = rs.choice([1, 2, 3, 12, 5, 9], size=18).astype(np.int32)
  params = SamplingSettings(max_new_tokens=T, eos_id=None, **SAMPLED)
  spec = engine.EngineSpec(num_slots=5, group_size=2, min_admit=min_admit)
  rng = jax.random.key(2)
  out, stats = engine.generate_continuous(model, tokens, mask, params, rng=rng, num_slots=5,
                                          group_size=2, limits=limits, min_admit=min_admit)
  assert_same(out, static_reference(model, tokens, mask, 2, limits, None, rng, **SAMPLED),
              exact=False)
  timeline = slot_schedule.simulate(limits, spec)
  assert timeline.decode_steps == int(stats.decode_steps)
  assert timeline.busy_slot_steps == int(stats.busy_slot_steps)
  assert len(timeline.prefill_widths) == int(stats.prefills)
  assert sum(timeline.prefill_widths) == int(stats.prefill_rows)
  # Every completion decodes its length - 1 tokens, one per step, in one slot.
  for k, length in enumerate(limits):
    assert (timeline.rows == k).sum() == length - 1
  # The static sampler over batches of 4 rows waits on each batch's longest row.
  static = slot_schedule.static_timeline(limits, 4)
  assert static.decode_steps == sum(int(limits[i:i + 4].max()) - 1 for i in range(0, 18, 4))
  assert static.busy_slot_steps == timeline.busy_slot_steps
  assert static.occupancy < timeline.occupancy


@pytest.mark.parametrize("chunk,n,sampling", [
    pytest.param(4, 2, SAMPLED, id="overlapping-passes-2-sampled"),
    pytest.param(2, 1, GREEDY, id="dividing-passes-1-greedy", marks=pytest.mark.slow)])
def test_chunked_prefill_interleaves_decode_steps_and_changes_no_completion(
    model, chunk, n, sampling):
  # Prompts of 6 columns in passes of 4 (columns 0-3, then 2-5: the last pass overlaps
  # the first) or of 2 (three passes); freed slots hold NaN.
  tokens, mask = queue(9, seed=5)
  rs = np.random.RandomState(6)
  limits = rs.choice([1, 2, 3, 12, 5, 9], size=9 * n).astype(np.int32)
  params = SamplingSettings(max_new_tokens=T, eos_id=None, **sampling)
  rng = jax.random.key(2)
  out, stats = engine.generate_continuous(model, tokens, mask, params, rng=rng, num_slots=5,
                                          group_size=n, limits=limits, prefill_chunk=chunk,
                                          cache_fill=float("nan"))
  assert_same(out, static_reference(model, tokens, mask, n, limits, None, rng, **sampling),
              exact=False)
  spec = engine.EngineSpec(num_slots=5, group_size=n, prefill_chunk=chunk)
  timeline = slot_schedule.simulate(limits, spec, prompt_len=6)
  assert timeline.decode_steps == int(stats.decode_steps)
  assert timeline.busy_slot_steps == int(stats.busy_slot_steps)
  assert len(timeline.prefill_widths) == int(stats.prefills)
  # The passes let decoding slots step while a prompt is being prefilled: the same
  # queue admitted whole runs fewer decode steps, each of them busier.
  whole = slot_schedule.simulate(limits, engine.EngineSpec(num_slots=5, group_size=n))
  assert whole.busy_slot_steps == timeline.busy_slot_steps
  assert whole.decode_steps < timeline.decode_steps


def test_prefill_passes_cover_the_prompt_and_end_at_its_last_column():
  spec = engine.EngineSpec(num_slots=4, prefill_chunk=16)
  assert spec.chunk_starts(64) == (0, 16, 32, 48)
  assert spec.chunk_starts(40) == (0, 16, 24)  # the last pass overlaps the one before
  assert spec.chunk_starts(16) == (0,) and spec.chunk_starts(8) == (0,)
  assert engine.EngineSpec(num_slots=4).chunk_starts(64) == (0,)
  assert spec.prefill_passes(40) == (3, 16) and spec.prefill_passes(8) == (1, 8)
  assert engine.EngineSpec(num_slots=4).prefill_passes(64) == (1, 64)
  with pytest.raises(ValueError, match="prefill_chunk must be an int >= 0"):
    engine.EngineSpec(num_slots=4, prefill_chunk=-1)
  with pytest.raises(ValueError, match="needs prompt_len"):
    slot_schedule.simulate([3, 4], spec)


def test_static_timeline_is_the_static_samplers_steps(model):
  tokens, mask = queue(8, seed=8)
  limits = np.array([1, 4, 12, 2, 3, 3, 1, 5], np.int32)
  params = dict(rng=jax.random.key(0), eos_id=None, **SAMPLED)
  steps = [int(generate(model, tokens[i:i + 4], mask[i:i + 4], T, limits=limits[i:i + 4],
                        **params).num_steps) - 1 for i in (0, 4)]
  assert slot_schedule.static_timeline(limits, 4).decode_steps == sum(steps)


def test_a_paged_cache_holds_the_busy_slots_pages_at_the_peak_step():
  # Slot 1's first row ends after one decode step and the third takes the slot: at each
  # step every busy row holds P + 1 + (steps since its admission) columns, in pages.
  F = slot_schedule.FREE
  timeline = slot_schedule.simulate([3, 2, 4], engine.EngineSpec(num_slots=2))
  np.testing.assert_array_equal(timeline.rows, [[0, 1], [0, 2], [F, 2], [F, 2]])
  # Pages of 2 over P = 4: 3 + 3 at steps 0 and 1, then 3, then 4 (7 columns).
  assert timeline.peak_paged_columns(4, 2) == 12
  assert timeline.peak_paged_columns(4, 8) == 16
  static = slot_schedule.static_timeline(np.array([3, 1]), 2)  # row 1 ends at its prefill
  assert static.peak_paged_columns(4, 4) == 8
  assert slot_schedule.simulate([1], engine.EngineSpec(num_slots=2)).peak_paged_columns(4, 2) == 0


def test_admissions_wait_for_a_quarter_of_the_widest_by_default():
  assert engine.EngineSpec(num_slots=16).floor == 4
  assert engine.EngineSpec(num_slots=4, group_size=2).floor == 1
  assert engine.EngineSpec(num_slots=16, min_admit=2).floor == 2
  with pytest.raises(ValueError, match=r"min_admit must be an int in \[1, 2\]"):
    engine.EngineSpec(num_slots=4, group_size=2, min_admit=3)


def _persistent(model, params, spec, tokens, mask, limits, num_rows):
  """A persistent engine (`step_fn`) over the queue, and a call helper."""
  graphdef, state = nnx.split(model)
  s = engine.init_state(model.config, spec, params, tokens.shape[1], num_rows, float("nan"))
  n = spec.group_size
  queue = engine.EngineQueue(tokens=tokens, mask=mask,
                             length=np.int32(len(tokens)),
                             rows=np.arange(len(tokens) * n, dtype=np.int32),
                             ids=np.arange(len(tokens) * n, dtype=np.int32),
                             limits=limits)
  step = engine.make_step_fn(graphdef, params, spec)
  return state, s, queue, step


def _offer(q, start, n):
  """The queue's entries from `start` on, in a queue of the same shape (as a host
  offers what is still pending at each call)."""
  def shift(a, k):
    return np.concatenate([np.asarray(a)[k:], np.asarray(a)[:k]])
  return q.replace(tokens=shift(q.tokens, start), mask=shift(q.mask, start),
                   length=np.int32(len(q.tokens) - start), rows=shift(q.rows, start * n),
                   ids=shift(q.ids, start * n), limits=shift(q.limits, start * n))


# Slow: tests/stages/test_rollout_stream.py holds the persistent engine, called in
# pieces, to the static sampler in the default tier.
@pytest.mark.slow
def test_a_persistent_engine_called_in_pieces_equals_the_static_sampler(model):
  # The queue is decoded over many calls of at most 3 decode steps each, one completion
  # to finish per call: slots carry their caches from call to call unchanged.
  n = 2
  tokens, mask = queue(5, seed=6)
  limits = np.array([1, 12, 4, 7, 12, 2, 9, 3, 5, 11], np.int32)
  rng = jax.random.key(4)
  params = SamplingSettings(max_new_tokens=T, eos_id=None, **SAMPLED)
  spec = engine.EngineSpec(num_slots=4, group_size=n)
  state, s, q, step = _persistent(model, params, spec, tokens, mask, limits, 10)
  calls, admitted = 0, 0
  while not bool(np.asarray(s.finished).all()):
    s = step(state, s, _offer(q, admitted, n), rng, np.int32(calls), np.int32(1),
             np.int32(3), np.zeros(4, bool))
    admitted += int(s.next_prompt)
    calls += 1
  assert calls > 5
  ref = static_reference(model, tokens, mask, n, limits, None, rng, **SAMPLED)
  assert_same(s, ref, exact=False)
  # Each token records the call (here: the version) that drew it, non-decreasing.
  versions = np.where(np.asarray(s.mask), np.asarray(s.versions), -1)
  assert (np.diff(np.where(versions < 0, calls, versions), axis=1) >= 0).all()
  assert len(np.unique(versions[versions >= 0])) > 3


def _mixed_logprobs(model, old_state, new_state, tokens, mask, completion, switch,
                    temperature):
  """Teacher-forced log-probs of a completion whose first `switch` tokens were drawn by
  the old weights and the rest by the new ones reading the cache as it was: keys and
  values of the prompt and of tokens < switch - 1 from the old weights (fed before the
  update), the later ones from the new weights."""
  from pipe_rlhf_jax.generation.sampler import completion_key_mask
  from pipe_rlhf_jax.models.transformer import KVCache, default_positions
  graphdef = nnx.split(model)[0]
  old, new = nnx.merge(graphdef, old_state), nnx.merge(graphdef, new_state)
  p = tokens.shape[1]
  full = np.concatenate([tokens, completion], axis=1)  # [B, P + T]
  positions = np.concatenate([np.asarray(default_positions(mask)),
                              mask.sum(1, keepdims=True) + np.arange(T)], axis=1)
  key_mask = completion_key_mask(mask, T)
  cache = KVCache.zeros(model.config, len(tokens), p + T)
  cut = p + switch - 1
  logits_old, cache = old.forward_cached(full[:, :cut], positions[:, :cut], key_mask, cache,
                                         0)
  logits_new, _ = new.forward_cached(full[:, cut:-1], positions[:, cut:-1], key_mask,
                                     cache, cut)
  logits = np.concatenate([np.asarray(logits_old)[:, p - 1:], np.asarray(logits_new)],
                          axis=1) / temperature  # [B, T, vocab]: predicts token t
  logp = logits - jax.scipy.special.logsumexp(logits, axis=-1, keepdims=True)
  return np.take_along_axis(np.asarray(logp), completion[..., None], axis=-1)[..., 0]


def test_new_weights_between_calls_continue_the_rows_under_the_new_policy(model):
  # A weight update between two calls, without draining: tokens drawn after it carry
  # the new version, and their behaviour log-probs are exactly what drew them (the new
  # weights over the cache as the rows had it), those before it the old weights'.
  tokens, mask = queue(3, seed=8)
  limits = np.full(3, T, np.int32)
  rng = jax.random.key(2)
  params = SamplingSettings(max_new_tokens=T, eos_id=None, temperature=0.9)
  spec = engine.EngineSpec(num_slots=3)
  state, s, q, step = _persistent(model, params, spec, tokens, mask, limits, 3)
  new_state = jax.tree.map(lambda x: x * 1.05 if x.dtype == np.float32 else x, state)
  none = np.zeros(3, bool)
  s = step(state, s, q, rng, np.int32(0), np.int32(3), np.int32(4), none)
  assert not bool(np.asarray(s.finished).any())  # mid-way: 1 + 4 tokens each
  s = step(new_state, s, q.replace(length=np.int32(0)), rng, np.int32(1), np.int32(3),
           np.int32(T), none)
  versions = np.asarray(s.versions)
  assert (versions[:, :5] == 0).all() and (versions[:, 5:] == 1).all()
  completion = np.asarray(s.tokens)
  want = _mixed_logprobs(model, state, new_state, tokens, mask, completion, 5, 0.9)
  np.testing.assert_allclose(np.asarray(s.logprobs), want, atol=3e-5)
  stale = _mixed_logprobs(model, state, state, tokens, mask, completion, 5, 0.9)
  assert np.abs(stale[:, 5:] - want[:, 5:]).max() > 1e-3  # the update changed the policy


def test_released_slots_take_new_prompts_and_leak_nothing(model):
  # Dropping a decoding completion (`release`) frees its slot; the prompt admitted into
  # it decodes exactly as in a fresh engine.
  tokens, mask = queue(2, seed=9)
  limits = np.full(2, T, np.int32)
  rng = jax.random.key(5)
  params = SamplingSettings(max_new_tokens=T, eos_id=None, **SAMPLED)
  spec = engine.EngineSpec(num_slots=1)
  state, s, q, step = _persistent(model, params, spec, tokens, mask, limits, 2)
  first = q.replace(length=np.int32(1))
  s = step(state, s, first, rng, np.int32(0), np.int32(1), np.int32(5), np.zeros(1, bool))
  s = step(state, s, _offer(q, 1, 1), rng, np.int32(0), np.int32(1), np.int32(T), np.ones(1, bool))
  # Row 1 is sample id 1: compare against the static sampler with that id.
  ref = generate(model, tokens[1:], mask[1:], T, rng=rng, eos_id=None, limits=limits[1:],
                 sample_ids=np.array([1], np.int32), **SAMPLED)
  np.testing.assert_array_equal(np.asarray(s.tokens)[1], np.asarray(ref.tokens)[0])
  np.testing.assert_allclose(np.asarray(s.logprobs)[1], np.asarray(ref.logprobs)[0],
                             atol=2e-5)
  assert not bool(np.asarray(s.finished)[0])  # the dropped completion never ended
