"""Tests for the plain KV-cache sampler (generation/sampler.py) on one device."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipe_rlhf_jax.generation import sampler
from pipe_rlhf_jax.generation.sampler import generate
from pipe_rlhf_jax.generation.sampling import policy_logprobs, sampling_logprobs, token_logprob
from pipe_rlhf_jax.models.config import tiny_config
from pipe_rlhf_jax.models.transformer import init_model

VOCAB = 64
SAMPLED = dict(temperature=0.7, top_k=12, top_p=0.9)
GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def model():
  config = tiny_config(vocab_size=VOCAB, embed_dim=32, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp_dim=64)
  return init_model(config, seed=3)


def make_prompts(lengths, width, seed=0):
  """Left-padded random prompts: int32 [B, width], bool [B, width]."""
  rs = np.random.RandomState(seed)
  tokens = np.zeros((len(lengths), width), np.int32)
  mask = np.zeros((len(lengths), width), bool)
  for row, n in enumerate(lengths):
    tokens[row, width - n:] = rs.randint(1, VOCAB, n)
    mask[row, width - n:] = True
  return tokens, mask


def full_forward_logits(model, prompt, prompt_mask, out):
  """Logits [B, T, vocab] predicting each generated token, from ONE full forward pass."""
  tokens = jnp.concatenate([jnp.asarray(prompt), out.tokens], axis=1)
  mask = jnp.concatenate([jnp.asarray(prompt_mask), out.mask], axis=1)
  graphdef, state = nnx.split(model)
  # Default positions (count of real tokens), as in training.
  logits = jax.jit(lambda s, t, m: nnx.merge(graphdef, s)(t, m))(state, tokens, mask)
  plen = prompt.shape[1]
  # Completion token i is predicted from the logits at sequence index P + i - 1.
  return logits[:, plen - 1:-1]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_logprobs_match_full_forward(model, sampling):
  prompt, mask = make_prompts([6, 4, 2, 5], 6)
  out = generate(model, prompt, mask, 6, rng=jax.random.key(1), eos_id=None, **sampling)
  assert out.tokens.shape == (4, 6) and out.tokens.dtype == jnp.int32
  assert out.logprobs.dtype == jnp.float32 and out.mask.dtype == jnp.bool_
  assert bool(out.mask.all()) and int(out.num_steps) == 6
  logits = full_forward_logits(model, prompt, mask, out)
  temperature = sampling.get("temperature", 1.0)
  # The recorded log-prob is the tempered, UNtruncated policy's (what PPO optimises),
  # even though the draw itself is filtered by top-k / top-p.
  policy = policy_logprobs(logits, temperature)
  np.testing.assert_allclose(out.logprobs, token_logprob(policy, out.tokens), atol=1e-5,
                             rtol=0)
  if sampling is GREEDY:
    np.testing.assert_array_equal(out.tokens, jnp.argmax(logits, axis=-1))
  else:
    # Every drawn token lies inside the top-k / top-p set...
    filtered = sampling_logprobs(logits, temperature, sampling["top_k"], sampling["top_p"])
    assert bool((token_logprob(filtered, out.tokens) > -1e29).all())
    # ...and the filter changed the numbers, so the check above is not vacuous.
    assert float(jnp.abs(token_logprob(filtered, out.tokens) - out.logprobs).max()) > 1e-3


def test_per_sample_keys_independent_of_batch_position(model):
  prompt, mask = make_prompts([6, 3, 5, 6], 6, seed=1)
  ids = np.array([10, 11, 12, 13], np.int32)
  rng = jax.random.key(7)
  full = generate(model, prompt, mask, 6, rng=rng, eos_id=None, sample_ids=ids,
                  **SAMPLED)
  order = np.array([3, 1])
  part = generate(model, prompt[order], mask[order], 6, rng=rng, eos_id=None,
                  sample_ids=ids[order], **SAMPLED)
  np.testing.assert_array_equal(part.tokens, full.tokens[order])
  np.testing.assert_allclose(part.logprobs, full.logprobs[order], atol=1e-5, rtol=0)
  # The key really depends on the id: the same prompt under other ids samples differently.
  other = generate(model, prompt, mask, 6, rng=rng, eos_id=None,
                   sample_ids=ids + 100, **SAMPLED)
  assert not np.array_equal(other.tokens, full.tokens)


def test_default_sample_ids_are_batch_rows(model):
  prompt, mask = make_prompts([4, 6], 6, seed=2)
  rng = jax.random.key(0)
  a = generate(model, prompt, mask, 6, rng=rng, eos_id=None, **SAMPLED)
  b = generate(model, prompt, mask, 6, rng=rng, eos_id=None, sample_ids=[0, 1], **SAMPLED)
  np.testing.assert_array_equal(a.tokens, b.tokens)


def test_eos_masks_and_pads_after_eos(model):
  prompt, mask = make_prompts([6, 3, 5, 6], 6, seed=4)
  rng = jax.random.key(3)
  free = generate(model, prompt, mask, 6, rng=rng, eos_id=None, **SAMPLED)
  eos = int(free.tokens[0, 3])
  out = generate(model, prompt, mask, 6, rng=rng, eos_id=eos, pad_id=VOCAB - 1, **SAMPLED)
  free_tokens = np.asarray(free.tokens)
  for row in range(4):
    hits = np.nonzero(free_tokens[row] == eos)[0]
    end = hits[0] + 1 if hits.size else 6  # tokens kept, EOS included
    np.testing.assert_array_equal(out.tokens[row, :end], free_tokens[row, :end])
    np.testing.assert_allclose(out.logprobs[row, :end], free.logprobs[row, :end],
                               atol=1e-6)
    assert out.mask[row, :end].all() and not out.mask[row, end:].any()
    assert (np.asarray(out.tokens[row, end:]) == VOCAB - 1).all()
    assert (np.asarray(out.logprobs[row, end:]) == 0).all()
  assert int(out.num_steps) == max(int(out.mask[r].sum()) for r in range(4))


def test_early_stop_when_every_row_is_done(model):
  # Identical prompts under greedy decoding produce identical rows; making their third
  # token EOS ends every row at once, so the loop must stop well before T.
  prompt, mask = make_prompts([5], 6, seed=5)
  prompt, mask = np.repeat(prompt, 4, 0), np.repeat(mask, 4, 0)
  steps = 6
  free = generate(model, prompt, mask, steps, rng=jax.random.key(0), eos_id=None, **GREEDY)
  eos = int(free.tokens[0, 2])
  first = int(np.nonzero(np.asarray(free.tokens[0]) == eos)[0][0])
  out = generate(model, prompt, mask, steps, rng=jax.random.key(0), eos_id=eos, **GREEDY)
  assert int(out.num_steps) == first + 1 < steps
  assert (np.asarray(out.mask.sum(axis=1)) == first + 1).all()
  assert (np.asarray(out.tokens[:, first + 1:]) == 0).all()
  np.testing.assert_array_equal(out.tokens[:, :first + 1], free.tokens[:, :first + 1])


@pytest.mark.parametrize("sampling, rows", [(GREEDY, [0]), (SAMPLED, [0, 2])],
                         ids=["greedy", "sampled"])
def test_left_padding_matches_each_prompt_alone(model, sampling, rows):
  lengths = [3, 6, 5, 6]
  prompt, mask = make_prompts(lengths, 6, seed=6)
  rng = jax.random.key(11)
  batch = generate(model, prompt, mask, 6, rng=rng, eos_id=None, **sampling)
  for row in rows:
    n = lengths[row]
    alone = generate(model, prompt[row:row + 1, 6 - n:], mask[row:row + 1, 6 - n:], 6,
                     rng=rng, eos_id=None, sample_ids=[row], **sampling)
    np.testing.assert_array_equal(alone.tokens[0], batch.tokens[row])
    np.testing.assert_allclose(alone.logprobs[0], batch.logprobs[row], atol=1e-5, rtol=0)


def test_building_blocks_donate_and_loop_on_device(model):
  prompt, mask = make_prompts([4, 4], 4, seed=8)
  params = sampler.SamplingSettings(max_new_tokens=5, temperature=0.0, eos_id=None)
  graphdef, state = nnx.split(model)
  prefill, decode = sampler.make_generate_fns(graphdef, params)
  ids = jnp.arange(2, dtype=jnp.int32)
  rng = jax.random.key(0)
  first = prefill(state, jnp.asarray(prompt), jnp.asarray(mask), rng, ids)
  assert first.cache.k.shape[3] == 4 + 5  # P + T slots
  assert int(first.step) == 1
  # The decode is one while loop, not a Python loop per token.
  jaxpr = jax.make_jaxpr(lambda *a: sampler.decode_fn(graphdef, *a, params))(
      state, first, jnp.asarray(mask), rng, ids)
  assert "while" in str(jaxpr)
  final = decode(state, first, jnp.asarray(mask), rng, ids)
  assert first.cache.k.is_deleted()  # donated into the loop
  want = generate(model, prompt, mask, 5, rng=rng, eos_id=None, **GREEDY)
  np.testing.assert_array_equal(final.output().tokens, want.tokens)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"),
])
def test_bad_sampling_settings_raise(model, kwargs, field):
  prompt, mask = make_prompts([3], 3)
  with pytest.raises(ValueError, match=field):
    generate(model, prompt, mask, 2, rng=jax.random.key(0), eos_id=None, **kwargs)


def test_right_padded_prompt_is_refused(model):
  prompt, mask = make_prompts([2, 3], 3)
  with pytest.raises(ValueError, match="(?i)left-padded"):
    generate(model, prompt, mask[:, ::-1], 2, rng=jax.random.key(0), eos_id=None)
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(model, prompt, mask, 0, rng=jax.random.key(0), eos_id=None)


def test_public_entry_points():
  from pipe_rlhf_jax import models
  import pipe_rlhf_jax.generation as generation
  import pipe_rlhf_jax.ppo as ppo
  assert generation.generate is generate
  assert callable(generation.pipelined_generate)
  assert callable(ppo.gae) and callable(ppo.policy_loss) and callable(ppo.value_loss)
  assert callable(models.from_pretrained) and callable(models.save_pretrained)


def _run_blocks(model, prompt, mask, sample_ids, group_size, steps=5):
  graphdef, state = nnx.split(model)
  params = sampler.SamplingSettings(max_new_tokens=steps, eos_id=None, **SAMPLED)
  prefill, decode = sampler.make_generate_fns(graphdef, params, group_size=group_size)
  rng = jax.random.key(7)
  first = prefill(state, prompt, mask, rng, sample_ids)
  cache = jax.tree.map(np.asarray, first.cache)
  return cache, decode(state, first, mask, rng, sample_ids).output()


def test_a_group_is_prefilled_once_and_samples_as_if_each_row_were(model):
  # 2 prompts x 4 samples (rows of one prompt consecutive, as `repeat_for_groups` lays
  # them out): prefilled as 2 rows and copied, the cache, the draws and their log-probs
  # are those of prefilling all 8 rows.
  prompt, mask = make_prompts([6, 3], 6, seed=4)
  prompt, mask = np.repeat(prompt, 4, 0), np.repeat(mask, 4, 0)
  ids = np.arange(8, dtype=np.int32)
  cache_each, each = _run_blocks(model, prompt, mask, ids, group_size=1)
  cache_once, once = _run_blocks(model, prompt, mask, ids, group_size=4)
  for a, b in zip(cache_each, cache_once):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(once.tokens), np.asarray(each.tokens))
  np.testing.assert_allclose(np.asarray(once.logprobs), np.asarray(each.logprobs),
                             rtol=1e-5, atol=1e-6)
  # The samples of a group differ (per-sample keys), the prompt's cache does not.
  assert len({tuple(r) for r in np.asarray(once.tokens)[:4]}) > 1
  with pytest.raises(ValueError, match="whole groups"):
    _run_blocks(model, prompt[:6], mask[:6], ids[:6], group_size=4)


def test_first_argmax_is_argmax_with_ties_and_nans():
  from pipe_rlhf_jax.generation.sampling import first_argmax
  rs = np.random.RandomState(0)
  x = rs.randint(0, 4, (64, 33)).astype(np.float32)  # many ties: the first one wins
  x[3, 7] = np.nan  # a NaN is the maximum, as for jnp.argmax
  x[5, [2, 9]] = np.nan
  x[6] = -np.inf
  got = np.asarray(jax.jit(first_argmax)(x))
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, np.asarray(jnp.argmax(x, axis=-1)))
