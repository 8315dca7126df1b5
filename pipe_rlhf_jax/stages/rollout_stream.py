"""Partial rollouts: the generation stage's slot engine kept running across PPO steps.

Owns `RolloutStream`, the host side of an engine (`generation/engine.py`, `step_fn`) that
is never drained. Its prompts come from a queue the stream refills from the prompt
source; a PPO batch is the first `ppo.batch_size` completions to finish (whole groups of
`ppo.group_size`, in the order their groups finished), and rows still decoding stay in
their slots, KV caches and all, for the next batch. Why: a static or one-shot batch waits
for its longest completion; here the trainer takes a batch as soon as enough rows have
ended, and the tail finishes while later batches decode.

Weights change between engine calls: every call first takes the newest weights the
staleness bound allows (`weights(min_version)`), and a call runs at most
`steps_per_call` decode steps, so an update reaches the running rows within that many
tokens, without draining. Every token records the version that drew it (the rollout's
`policy_version` is per token, [batch, T]) and its behaviour log-prob is that version's,
so the off-policy correction (`ppo.loss = "decoupled_ppo_clip"`'s behaviour weights) is
exact per token.

The staleness bound applies to a completion's oldest token (its group's admission): a
batch for PPO step k wants every token from version k - max_staleness or newer. A group
admitted earlier is, by `past_staleness`, either trained on anyway ("finish", counted in
`rollout/past_staleness`) or dropped, its rows freed and its prompt re-queued at the
front ("drop", counted in `rollout/dropped`).

Nothing is lost on a stop: `data_state()` gives the prompt source's state after the last
prompt read and every prompt read but not yet in a formed batch (queued, decoding, or
finished in a group still waiting for its siblings) as plain JSON; a resumed stream
re-queues them first, and a completion's draws depend on its sample id and position
only (`sampling.token_keys`), so a resumed run takes every prompt once.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable

from flax import nnx
import jax
import numpy as np

from pipe_rlhf_jax.distributed.arrays import fetch, put_global
from pipe_rlhf_jax.generation import engine as engine_lib
from pipe_rlhf_jax.ppo.types import Rollout

# The key under which a data state carries the stream's prompts (beside "source").
IN_FLIGHT = "in_flight"


def split_data_state(state: dict | None) -> tuple[dict | None, list[dict]]:
  """(the prompt source's own state, the stream's prompt records) of a checkpoint's data
  state; a state without partial rollouts is the source's alone."""
  if isinstance(state, dict) and IN_FLIGHT in state:
    return state.get("source"), list(state[IN_FLIGHT])
  return state, []


def _to_json(record: dict) -> dict:
  return {k: {"dtype": str(np.asarray(v).dtype), "data": np.asarray(v).tolist()}
          for k, v in record.items()}


def _from_json(record: dict) -> dict:
  return {k: np.asarray(v["data"], dtype=v["dtype"]) for k, v in record.items()}


@dataclasses.dataclass(eq=False)  # groups compare by identity
class _Group:
  """One prompt's n completions while the stream holds them.

  Attributes:
    record: the prompt's row of its batch (host arrays).
    rows: the engine rows of its completions still decoding (sample j -> row).
    oldest: the version that drew its first tokens (its admission's).
    outputs: sample j -> (tokens, logprobs, mask, versions) [T] each, once it ended.
  """

  record: dict
  rows: dict[int, int]
  oldest: int
  outputs: dict[int, tuple[np.ndarray, ...]] = dataclasses.field(default_factory=dict)


class RolloutStream:
  """Batches of finished completions from a slot engine that keeps running.

  Args:
    stage: the generation stage (its layout, graphdef, sampling settings, group size
      and slot count).
    completions: B, completions per batch (a multiple of the group size).
    rng: the run's generation key (the same for every call).
    max_staleness: the bound on a completion's oldest token.
    past_staleness: "finish" or "drop" (`Plan.past_staleness`).
    steps_per_call: decode steps an engine call runs at most before it looks for
      newer weights.
    in_flight: JSON prompt records of a checkpoint (`data_state`), re-queued first.
  """

  def __init__(self, stage, completions: int, rng: jax.Array, *, max_staleness: int,
               past_staleness: str = "finish", steps_per_call: int = 16,
               in_flight: list[dict] = ()):
    n = stage.group_size
    if completions % n:
      raise ValueError(f"ppo.batch_size={completions} is not a multiple of "
                       f"ppo.group_size={n}.")
    self.stage = stage
    self.n = n
    self.completions = completions
    self.rng = rng
    self.max_staleness = max_staleness
    self.past_staleness = past_staleness
    self.steps_per_call = steps_per_call
    self.spec = engine_lib.EngineSpec(num_slots=max(stage.num_slots, n), group_size=n,
                                      prefill_chunk=stage.prefill_chunk)
    # Rows in flight never exceed the slots; as many again hold the rows a call's queue
    # offers before it knows how many it admits.
    self.num_rows = 2 * self.spec.num_slots
    self.queue_cap = self.spec.num_slots // n + completions // n
    self.pending: collections.deque[dict] = collections.deque(
        _from_json(r) for r in in_flight)
    self.decoding: list[_Group] = []  # admitted, some completion still decoding
    self.complete: list[_Group] = []  # every completion ended, in the order they did
    self.free_rows = list(range(self.num_rows))
    self.state = None
    self.slot_rows = np.full((self.spec.num_slots,), engine_lib.FREE)
    self._release = np.zeros((self.spec.num_slots,), bool)
    self._step = engine_lib.make_step_fn(stage.graphdef, stage.sampling, self.spec)
    self._source_state: dict | None = None
    self._fetches = 0

  # ---- the prompt queue ----------------------------------------------------------------
  def _refill(self, feed) -> None:
    """Reads prompt batches until the queue holds what the slots and one batch take."""
    while len(self.pending) < self.queue_cap:
      batch = feed.read(self._fetches)
      self._fetches += 1
      rows = len(batch["prompt_tokens"])
      self.pending.extend({k: np.asarray(v)[i] for k, v in batch.items()}
                          for i in range(rows))
      self._source_state = feed.current_state()

  def data_state(self, feed) -> dict:
    """What a checkpoint stores to resume here: the source's state after the last prompt
    read, and every prompt read and not yet in a formed batch (JSON)."""
    held = [g.record for g in self.complete + self.decoding] + list(self.pending)
    source = self._source_state if self._fetches else feed.current_state()
    return {"source": source, IN_FLIGHT: [_to_json(r) for r in held]}

  # ---- engine calls ----------------------------------------------------------------------
  def _init(self, params: nnx.State, prompt_len: int) -> None:
    spec, stage = self.spec, self.stage

    def init(state):
      config = nnx.merge(stage.graphdef, state).config
      return engine_lib.init_state(config, spec, stage.sampling, prompt_len, self.num_rows)

    with stage.layout.rules_context():
      self.state = jax.jit(init)(params)

  def _queue(self) -> tuple[engine_lib.EngineQueue, list[list[int]]]:
    """The pending prompts the free rows can take, as an engine queue of fixed shape."""
    n = self.n
    take = min(len(self.pending), len(self.free_rows) // n, self.queue_cap)
    records = [self.pending[i] for i in range(take)]
    prompt_len = self.pending[0]["prompt_tokens"].shape[0]
    tokens = np.zeros((self.queue_cap, prompt_len), np.int32)
    mask = np.ones((self.queue_cap, prompt_len), bool)
    rows = np.full((self.queue_cap * n,), engine_lib.FREE, np.int32)
    ids = np.zeros((self.queue_cap * n,), np.int32)
    assigned = []
    for i, r in enumerate(records):
      tokens[i], mask[i] = r["prompt_tokens"], r["prompt_mask"]
      group_rows = self.free_rows[i * n:(i + 1) * n]
      assigned.append(group_rows)
      rows[i * n:(i + 1) * n] = group_rows
      ids[i * n:(i + 1) * n] = int(r["index"]) * n + np.arange(n)
    cap = self.stage.sampling.max_new_tokens
    limits = np.full_like(ids, cap)
    for i, r in enumerate(records):  # a prompt's own budget (`GenerateStage`), at most T
      if "max_new_tokens" in r:
        limits[i * n:(i + 1) * n] = min(int(r["max_new_tokens"]), cap)
    queue = engine_lib.EngineQueue(tokens=tokens, mask=mask,
                                   length=np.asarray(take, np.int32),
                                   rows=rows, ids=ids, limits=limits)
    return put_global(queue, self.stage.layout.replicated), assigned

  def _call(self, params: nnx.State, version: int, target: int, stats: dict) -> None:
    """One engine call: admit, decode, then collect the completions that ended."""
    if self.state is None:
      self._init(params, self.pending[0]["prompt_tokens"].shape[0])
    queue, assigned = self._queue()
    scalars = put_global((np.asarray(version, np.int32), np.asarray(target, np.int32),
                          np.asarray(self.steps_per_call, np.int32), self._release.copy()),
                         self.stage.layout.replicated)
    with self.stage.layout.rules_context():
      self.state = self._step(params, self.state, queue, self.rng, *scalars)
    self._release[:] = False
    s = self.state
    admitted, finished, row, st = fetch((s.next_prompt, s.finished, s.row, s.stats))
    self.slot_rows = np.asarray(row)
    for i in range(int(admitted)):
      record = self.pending.popleft()
      rows = assigned[i]
      del self.free_rows[:self.n]
      self.decoding.append(_Group(record=record, rows=dict(enumerate(rows)),
                                  oldest=version))
    ended = [(g, j, r) for g in self.decoding for j, r in g.rows.items() if finished[r]]
    if ended:
      out = fetch((s.tokens, s.logprobs, s.mask, s.versions))
      for g, j, r in ended:
        g.outputs[j] = tuple(np.array(a[r]) for a in out)
        del g.rows[j]
        self.free_rows.append(r)
    for g in [g for g in self.decoding if not g.rows]:
      self.decoding.remove(g)
      self.complete.append(g)
    for key, value in (("decode_steps", st.decode_steps), ("busy", st.busy_slot_steps),
                       ("prefills", st.prefills)):
      stats[key] += int(value)

  def _drop_stale(self, min_version: int) -> int:
    """Drops the groups whose oldest token is older than `min_version`; their prompts go
    back to the front of the queue. Returns the completions dropped."""
    stale = [g for g in self.complete + self.decoding if g.oldest < min_version]
    for g in reversed(stale):
      for r in g.rows.values():
        self._release |= self.slot_rows == r
        self.free_rows.append(r)
      (self.complete if g in self.complete else self.decoding).remove(g)
      self.pending.appendleft(g.record)
    return len(stale) * self.n

  def _target(self, groups: int) -> int:
    """Completions that must still end before `groups` more groups are complete."""
    left = sorted(len(g.rows) for g in self.decoding)[:groups]
    return max(1, sum(left) + self.n * max(0, groups - len(left)))

  # ---- batches ---------------------------------------------------------------------------
  def next_batch(self, step: int, feed, weights: Callable[[int], tuple[Any, int]]
                 ) -> tuple[Rollout, dict]:
    """The rollout of PPO step `step`: the first B completions (whole groups) to finish.

    Args:
      step: the PPO step the batch is for (its staleness bound is step - max_staleness).
      feed: the prompt source (`system.steps.DataFeed`).
      weights: `weights(min_version)` -> (params, version), the newest weights at least
        that new (blocking until they exist).

    Returns:
      The Rollout on the generation stage's mesh, with per-token `policy_version`, and
      metrics.
    """
    start = time.perf_counter()
    min_version = max(0, step - self.max_staleness)
    dropped = self._drop_stale(min_version) if self.past_staleness == "drop" else 0
    groups = self.completions // self.n
    stats = collections.Counter()
    calls = 0
    while len(self.complete) < groups:
      self._refill(feed)
      params, version = weights(min_version)
      self._call(params, version, self._target(groups - len(self.complete)), stats)
      calls += 1
    batch, self.complete = self.complete[:groups], self.complete[groups:]
    rollout = self._rollout(batch)
    versions = np.stack([g.outputs[j][3] for g in batch for j in range(self.n)])
    masks = np.stack([g.outputs[j][2] for g in batch for j in range(self.n)])
    oldest = np.array([g.oldest for g in batch for _ in range(self.n)])
    newest = np.where(masks, versions, -1).max(axis=1)
    tokens = float(masks.sum())
    seconds = time.perf_counter() - start
    slot_steps = stats["decode_steps"] * self.spec.num_slots
    metrics = {
        "time/generate_s": seconds, "generate/tokens_per_s": tokens / max(seconds, 1e-9),
        "generate/slot_occupancy": stats["busy"] / max(slot_steps, 1),
        "generate/engine_calls": float(calls),
        "rollout/dropped": float(dropped),
        "rollout/past_staleness": float((oldest < min_version).sum()),
        "rollout/mixed_versions": float((newest > oldest).mean()),
        "rollout/carried": float(sum(len(g.rows) for g in self.decoding)),
        "version/oldest_token": float(oldest.min()),
        "version/newest_token": float(newest.max()),
    }
    return rollout, metrics

  def _rollout(self, groups: list[_Group]) -> Rollout:
    """The groups' completions in the shared `[prompt | completion]` layout."""
    n = self.n

    def stack(key):
      return np.repeat(np.stack([g.record[key] for g in groups]), n, axis=0)

    def outputs(i):
      return np.stack([g.outputs[j][i] for g in groups for j in range(n)])

    host = {"prompt_tokens": stack("prompt_tokens"),
            "prompt_mask": stack("prompt_mask").astype(bool),
            "completion_tokens": outputs(0), "behaviour_logprobs": outputs(1),
            "completion_mask": outputs(2), "policy_version": outputs(3)}
    if "answer_bytes" in groups[0].record:
      host["answer_bytes"] = stack("answer_bytes").astype(np.uint8)
    arrays = self.stage.layout.put_batch(host)
    return Rollout(**{k: arrays[k] if k in arrays else None for k in (
        "prompt_tokens", "prompt_mask", "completion_tokens", "completion_mask",
        "behaviour_logprobs", "policy_version", "answer_bytes")})

  def __repr__(self) -> str:
    return (f"RolloutStream(B={self.completions}, n={self.n}, S={self.spec.num_slots}, "
            f"pending={len(self.pending)}, decoding={len(self.decoding)}, "
            f"complete={len(self.complete)})")

