"""Partial rollouts (stages/rollout_stream.py): batches of finished completions from an
engine that keeps running, the staleness choices, and resuming without losing a prompt."""

import json

from flax import nnx
import jax
import numpy as np
import pytest

from pipe_rlhf_jax.generation.sampler import SamplingSettings, generate
from pipe_rlhf_jax.models.config import tiny_config
from pipe_rlhf_jax.models.transformer import init_model
from pipe_rlhf_jax.parallel import logical
from pipe_rlhf_jax.parallel.mesh import make_mesh
from pipe_rlhf_jax.stages.common import StageLayout
from pipe_rlhf_jax.stages.generate import GenerateStage, repeat_for_groups
from pipe_rlhf_jax.stages.rollout_stream import RolloutStream, split_data_state
from pipe_rlhf_jax.system.steps import DataFeed

VOCAB, PROMPT, T = 64, 5, 10


class Prompts:
  """An endless, resumable prompt source of batches of 2 prompts, ids counting up."""

  def __init__(self):
    self.next_index = 0

  def __iter__(self):
    return self

  def __next__(self):
    rs = np.random.RandomState(self.next_index)
    tokens = rs.randint(1, VOCAB, (2, PROMPT)).astype(np.int32)
    mask = np.ones((2, PROMPT), bool)
    mask[0, :2] = False
    index = np.arange(self.next_index, self.next_index + 2, dtype=np.int32)
    self.next_index += 2
    return {"prompt_tokens": tokens, "prompt_mask": mask, "index": index}

  def get_state(self):
    return {"next_index": self.next_index}

  def set_state(self, state):
    self.next_index = state["next_index"]


@pytest.fixture(scope="module")
def actor():
  config = tiny_config(vocab_size=VOCAB, embed_dim=32, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp_dim=64)
  return nnx.split(init_model(config, seed=3))


def make_stream(actor, n=2, in_flight=(), past="finish", eos=None):
  layout = StageLayout("generate", make_mesh({"data": 1}, jax.devices()[:1]),
                       logical.DEFAULT_RULES)
  sampling = SamplingSettings(max_new_tokens=T, temperature=1.0, eos_id=eos)
  stage = GenerateStage(layout, actor[0], sampling, group_size=n, num_slots=4)
  return RolloutStream(stage, 4, jax.random.key(0), max_staleness=1, past_staleness=past,
                       steps_per_call=3, in_flight=list(in_flight))


def frequent_token(actor):
  probe = generate(nnx.merge(*actor), np.ones((4, PROMPT), np.int32),
                   np.ones((4, PROMPT), bool), T, rng=jax.random.key(0), eos_id=None)
  return int(np.bincount(np.asarray(probe.tokens).ravel()).argmax())


def prompt_ids(rollout, n):
  """The prompt of each group, by its tokens' hash (the rollout carries no index)."""
  tokens = np.asarray(rollout.prompt_tokens)[::n]
  return [tokens[i].tobytes() for i in range(len(tokens))]


def test_batches_are_whole_groups_of_finished_completions_under_one_policy(actor):
  # Same weights throughout: every completion equals the static sampler's for its
  # prompt and sample id, whichever batch and engine call it finished in.
  stream = make_stream(actor, eos=frequent_token(actor))
  feed = DataFeed(Prompts())
  params = actor[1]
  seen = []
  for step in range(3):
    rollout, metrics = stream.next_batch(step, feed, lambda v: (params, 0))
    assert rollout.completion_tokens.shape == (4, T)
    assert np.asarray(rollout.policy_version).shape == (4, T)
    tokens = np.asarray(rollout.prompt_tokens)
    assert (tokens[0::2] == tokens[1::2]).all()  # groups of 2, consecutive
    seen += prompt_ids(rollout, 2)
    assert metrics["generate/engine_calls"] >= 1
    assert 0 < metrics["generate/slot_occupancy"] <= 1
  assert len(seen) == len(set(seen))  # no prompt twice
  # Recompute one batch's completions with the static sampler, by the sample ids the
  # stream gives (prompt index * n + j) and the run's key.
  source = Prompts()
  by_prompt = {}
  for _ in range(6):
    batch = repeat_for_groups(next(source), 2)
    out = generate(nnx.merge(*actor), batch["prompt_tokens"], batch["prompt_mask"], T,
                   rng=jax.random.key(0), eos_id=stream.stage.sampling.eos,
                   sample_ids=batch["index"])
    for row in range(len(batch["index"])):
      key = (batch["prompt_tokens"][row].tobytes(), int(batch["index"][row]) % 2)
      by_prompt[key] = (np.asarray(out.tokens)[row], np.asarray(out.logprobs)[row])
  rows = np.asarray(rollout.completion_tokens)
  for row in range(4):
    want, want_lp = by_prompt[(np.asarray(rollout.prompt_tokens)[row].tobytes(), row % 2)]
    np.testing.assert_array_equal(rows[row], want)
    np.testing.assert_allclose(np.asarray(rollout.behaviour_logprobs)[row], want_lp,
                               atol=2e-5)


def test_drop_requeues_stale_groups_and_finish_counts_them(actor):
  # Weights move on every call, and the trainer runs ahead (PPO step 6k for batch k):
  # groups carried over from the previous batch are past a bound of 1.
  version = [0]

  def weights(min_version):
    version[0] = max(version[0] + 1, min_version)
    return actor[1], version[0]

  eos = frequent_token(actor)  # varied lengths: some groups outlive their batch
  for past in ("finish", "drop"):
    stream = make_stream(actor, past=past, eos=eos)
    feed = DataFeed(Prompts())
    version[0] = 0
    totals = {"rollout/dropped": 0.0, "rollout/past_staleness": 0.0}
    for step in range(4):
      rollout, metrics = stream.next_batch(step * 6, feed, weights)
      for key in totals:
        totals[key] += metrics[key]
      versions = np.where(np.asarray(rollout.completion_mask),
                          np.asarray(rollout.policy_version), 10**6)
      oldest = versions.min(axis=1)
      if past == "drop":
        assert (oldest >= step * 6 - 1).all()  # every completion within the bound
    assert totals["rollout/dropped" if past == "drop" else "rollout/past_staleness"] > 0


def test_a_resumed_stream_loses_no_prompt_and_takes_none_twice(actor):
  # Three batches, a checkpoint of the data state (JSON), then a new stream (new
  # engine, a fresh source restored from the state) for three more: every prompt read
  # is trained once or still held, none twice.
  source = Prompts()
  stream = make_stream(actor, eos=frequent_token(actor))
  feed = DataFeed(source)
  params = actor[1]
  trained = []
  for step in range(3):
    rollout, _ = stream.next_batch(step, feed, lambda v: (params, 0))
    trained += prompt_ids(rollout, 2)
  state = json.loads(json.dumps(stream.data_state(feed)))
  source_state, held = split_data_state(state)
  assert held  # the test exercises prompts in flight
  resumed_source = Prompts()
  resumed_source.set_state(source_state)
  stream = make_stream(actor, in_flight=held, eos=frequent_token(actor))
  feed = DataFeed(resumed_source)
  for step in range(3, 6):
    rollout, _ = stream.next_batch(step, feed, lambda v: (params, 0))
    trained += prompt_ids(rollout, 2)
  assert len(trained) == len(set(trained)) == 12
  still_held = {np.asarray(r["prompt_tokens"]["data"], np.int32).tobytes()
                for r in split_data_state(stream.data_state(feed))[1]}
  read = Prompts()
  everything = {t.tobytes() for _ in range(resumed_source.next_index // 2)
                for t in next(read)["prompt_tokens"]}
  assert set(trained) | still_held == everything
  assert not set(trained) & still_held


def test_a_data_state_without_partial_rollouts_is_the_sources():
  assert split_data_state({"next_index": 4}) == ({"next_index": 4}, [])
  assert split_data_state(None) == (None, [])


class Budgeted(Prompts):
  """Prompts with their own length budgets (`max_new_tokens`), 1 to T."""

  def __next__(self):
    batch = super().__next__()
    batch["max_new_tokens"] = 1 + batch["index"] * 3 % T
    return batch


# The stream (this module's subject) in the default run; the stage's static batches and
# its slots, each its own compiled decoder, in the slow tier.
@pytest.mark.parametrize("engine", ["stream", pytest.param("static", marks=pytest.mark.slow),
                                    pytest.param("slots", marks=pytest.mark.slow)])
def test_a_prompts_own_length_budget_holds_in_every_engine(actor, engine):
  layout = StageLayout("generate", make_mesh({"data": 1}, jax.devices()[:1]),
                       logical.DEFAULT_RULES)
  sampling = SamplingSettings(max_new_tokens=T, temperature=1.0, eos_id=None)
  batch = next(Budgeted())
  if engine != "stream":
    stage = GenerateStage(layout, actor[0], sampling, group_size=2,
                          num_slots=2 if engine == "slots" else 0)
    rollout, _ = stage(actor[1], batch, jax.random.key(0), 0)
    np.testing.assert_array_equal(np.asarray(rollout.completion_mask).sum(1),
                                  np.repeat(batch["max_new_tokens"], 2))
    return
  stream = make_stream(actor)
  source = Budgeted()
  budget = {}  # each prompt's own budget, by its tokens (the rollout carries no index)
  for _ in range(8):
    b = next(source)
    budget.update((t.tobytes(), int(m)) for t, m in zip(b["prompt_tokens"],
                                                        b["max_new_tokens"]))
  feed = DataFeed(Budgeted())
  for step in range(2):  # the second batch's prompts queue behind others' budgets
    rollout, _ = stream.next_batch(step, feed, lambda v: (actor[1], 0))
    lengths = np.asarray(rollout.completion_mask).sum(1)
    expected = [budget[t.tobytes()] for t in np.asarray(rollout.prompt_tokens)]
    np.testing.assert_array_equal(lengths, expected)
  with pytest.raises(ValueError, match="max_new_tokens must be one integer >= 1"):
    bad = dict(batch, max_new_tokens=np.zeros(2, np.int32))
    GenerateStage(layout, actor[0], sampling)(actor[1], bad, jax.random.key(0), 0)
