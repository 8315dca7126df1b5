"""Continuous batching for the plain KV-cache decoder: a queue of prompts over S slots.

This module owns the slot engine: one jitted `lax.while_loop` that decodes a queue of
prompts with a fixed number of *slots* (rows of the running batch, each with its own
region of the KV cache). A slot whose completion emits EOS or reaches its length frees
at once, and the next prompts of the queue are prefilled into the free slots between
two decode steps, inside the same program: no host round-trip per token or per refill.

Why: the static sampler (`sampler.py`) decodes a fixed batch until its longest row ends,
so on a long-tailed length distribution most slot-steps produce nothing. Here a slot is
busy as long as the queue has prompts; only the queue's last completions leave slots
idle.

The engine changes scheduling, not mathematics: a completion is a function of the
weights, its prompt and its sampling key alone. Each slot's cache region has the static
sampler's layout (prompt left-padded in columns [0, P), completion token t at column
P + t), its rows are attended with the same masks, and token t of sample id i is drawn
with `token_keys(rng, i, t)` whichever slot and step draw it; so every completion and
its log-probs equal the static sampler's for the same key (tests check it, greedy and
sampled, with tensor parallelism).

Admission: prompts enter in queue order, a prompt's n group samples together (one
prefill per prompt, its cache copied into n slots, as the static sampler's group
prefill does). An admission prefills w prompts at once, w the largest of the static
widths 1, 2, 4, ... `max_admit` that the free slots and the queue allow: one compiled
prefill per width, chosen with `lax.switch`. The loop admits while an admission is due
(at least `min_admit` prompts' slots free, or nothing decoding), then runs decode steps
until the next one is due: the decode loop's body is the decode step alone, and no
conditional carries the cache through unchanged (XLA would copy it every step). By default a
whole prompt is prefilled in one pass, so the running decode waits one prefill of w
prompts (at P tokens each about the cost of P / S decode steps per prompt). With
`prefill_chunk` C the admission runs its prompts in passes of C columns and the running
slots take one decode step between two passes: a decode step waits at most a pass of
w x C tokens, not w x P (the tokens' latency, not the throughput: the passes do the same
work). A newcomer's region is overwritten whole (zeros past its prompt), so whatever a
freed slot held, NaN included, never reaches it.

The same loop also runs as a persistent engine (`step_fn`, for partial rollouts in
`stages/rollout_stream.py`): its state is kept between calls, a call stops once a target
number of completions has ended (or after a bound on decode steps, so that new weights
are taken between two calls without draining), and output rows are a ring the caller
assigns and recycles.

The KV cache is contiguous per slot (S x (P + T) columns). A paged cache would let slots
share a token budget instead of each reserving P + T columns; on CPU, where the slot
count is bounded by compute rather than by cache memory, the contiguous layout avoids
the page-table gather in every attention read.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from flax import nnx, struct
import jax
import jax.numpy as jnp
import numpy as np

from pipe_rlhf_jax.generation.sampler import (
  GenerationOutput,
  SamplingSettings,
  check_prompts,
  completion_key_mask,
  next_tokens,
)
from pipe_rlhf_jax.models.transformer import CACHE_AXES, KVCache, default_positions
from pipe_rlhf_jax.parallel.logical import constrain, current_axis_rules

FREE = -1  # `EngineState.row` of a slot that holds no completion


@struct.dataclass
class EngineStats:
  """What the engine did, for occupancy and throughput metrics (per call).

  Attributes:
    decode_steps: int32 []: decode steps run (each computes every slot).
    busy_slot_steps: int32 []: slot-steps that produced a token (decode steps only;
      prefills draw each completion's first token).
    prefills: int32 []: admissions run.
    prefill_rows: int32 []: prompt rows computed by the admissions (padding included).
  """

  decode_steps: jax.Array
  busy_slot_steps: jax.Array
  prefills: jax.Array
  prefill_rows: jax.Array


@struct.dataclass
class EngineQueue:
  """The prompts one call may admit, in admission order.

  Attributes:
    tokens, mask: [Q, P] left-padded prompts (one row per prompt, not per sample).
    length: int32 []: entries of the queue that are real (the rest pad a fixed shape).
    rows: int32 [Q * n]: output row of each completion (sample k % n of prompt k // n).
    ids: int32 [Q * n]: its sample id (`token_keys(rng, id, t)` draws token t).
    limits: int32 [Q * n]: its length budget (at most T).
  """

  tokens: jax.Array
  mask: jax.Array
  length: jax.Array
  rows: jax.Array
  ids: jax.Array
  limits: jax.Array


@struct.dataclass
class EngineState:
  """The loop carry, and between calls the engine itself (slots keep decoding across
  calls: `step_fn`).

  Attributes:
    cache: KVCache [layers, S, kv_heads, P + T, head_dim], one region per slot.
    key_mask: bool [S, P + T]: the slot's prompt mask, then every completion column.
    num_real: int32 [S]: real prompt tokens of the slot's prompt.
    row: int32 [S]: output row of the slot's completion, FREE when idle.
    step: int32 [S]: index of the next completion token the slot draws.
    last_token: int32 [S]: the token to feed at the slot's next decode step.
    slot_id: int32 [S]: the sample id of the slot's completion.
    slot_limit: int32 [S]: its length budget.
    next_prompt: int32 []: entries of this call's queue admitted so far.
    tokens, logprobs, mask: [R, T] output rows.
    versions: int32 [R, T]: the policy version that drew each token.
    finished: bool [R]: the row's completion has ended (EOS or its budget).
    done: int32 []: completions that ended during this call.
    stats: EngineStats of this call.
  """

  cache: KVCache
  key_mask: jax.Array
  num_real: jax.Array
  row: jax.Array
  step: jax.Array
  last_token: jax.Array
  slot_id: jax.Array
  slot_limit: jax.Array
  next_prompt: jax.Array
  tokens: jax.Array
  logprobs: jax.Array
  mask: jax.Array
  versions: jax.Array
  finished: jax.Array
  done: jax.Array
  stats: EngineStats


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """Static shape of one engine program (hashable: it keys the jit cache).

  Attributes:
    num_slots: S, completions decoded at once.
    group_size: n, completions per prompt (consecutive output rows).
    max_admit: the widest admission, in prompts (default: as many as S slots hold).
    min_admit: the narrowest admission while other slots are decoding, in prompts: the
      engine leaves up to min_admit x n - 1 slots idle so that a prefill runs several
      prompts at once (a one-prompt prefill runs the weights over P tokens only, at a
      fraction of a batched prefill's rate). It admits fewer when no slot is decoding
      or fewer prompts are left. Default: a quarter of the widest admission, which on
      the long-tailed queue of `experiments/bench_rollout.py` (16 slots) ran faster than
      admitting every free slot at once.
    prefill_chunk: prompt columns per prefill pass (0: the whole prompt in one pass).
      With C < P an admission runs ceil(P / C) passes of C columns, the last ending at
      the prompt's end (`chunk_starts`), and the decoding slots take one decode step
      between two passes.
  """

  num_slots: int
  group_size: int = 1
  max_admit: int | None = None
  min_admit: int | None = None
  prefill_chunk: int = 0

  def __post_init__(self):
    for name in ("num_slots", "group_size"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if self.num_slots < self.group_size:
      raise ValueError(
          f"num_slots={self.num_slots} cannot hold one group of {self.group_size} samples: "
          f"use at least {self.group_size} slots (a group is admitted whole).")
    if self.max_admit is not None and (not isinstance(self.max_admit, (int, np.integer))
                                       or self.max_admit < 1):
      raise ValueError(f"max_admit must be a positive int or None, got {self.max_admit!r}")
    if self.min_admit is not None and (
        isinstance(self.min_admit, bool) or not isinstance(self.min_admit, (int, np.integer))
        or not 1 <= self.min_admit <= self.widths[-1]):
      raise ValueError(f"min_admit must be an int in [1, {self.widths[-1]}] (the widest "
                       f"admission {self.num_slots} slots allow), got {self.min_admit!r}")
    if isinstance(self.prefill_chunk, bool) or not isinstance(
        self.prefill_chunk, (int, np.integer)) or self.prefill_chunk < 0:
      raise ValueError(f"prefill_chunk must be an int >= 0 (prompt columns per prefill "
                       f"pass; 0: the whole prompt), got {self.prefill_chunk!r}")

  def chunk_starts(self, prompt_len: int) -> tuple[int, ...]:
    """First prompt column of each prefill pass over a prompt of `prompt_len` columns.

    (0,) without chunking (or C >= P). Otherwise ceil(P / C) passes of C columns each,
    the last one ending at column P so that its last position draws the first token;
    where C does not divide P it overlaps the pass before, whose columns it computes
    again from the same keys (the same keys and values, written twice).
    """
    size = self.prefill_chunk
    if not size or size >= prompt_len:
      return (0,)
    return tuple(min(i * size, prompt_len - size) for i in range(-(-prompt_len // size)))

  def prefill_passes(self, prompt_len: int) -> tuple[int, int]:
    """(passes, columns per pass) of one admission's prefill: (1, P) without chunking,
    else (ceil(P / C), C), the overlapping last pass counted whole (it computes C columns)."""
    passes = len(self.chunk_starts(prompt_len))
    return passes, prompt_len if passes == 1 else self.prefill_chunk

  @property
  def floor(self) -> int:
    """The narrowest admission while slots decode (`min_admit`, resolved)."""
    return self.min_admit if self.min_admit is not None else max(1, self.widths[-1] // 4)

  @property
  def widths(self) -> tuple[int, ...]:
    """Admission widths in prompts: powers of two up to the widest."""
    widest = self.num_slots // self.group_size
    if self.max_admit is not None:
      widest = min(widest, self.max_admit)
    out, w = [], 1
    while w <= widest:
      out.append(w)
      w *= 2
    return tuple(out)


def init_state(model_config, spec: EngineSpec, params: SamplingSettings, prompt_len: int,
               num_rows: int, cache_fill: float = 0.0) -> EngineState:
  """An engine with every slot free and `num_rows` empty output rows.

  Args:
    model_config: the model's TransformerConfig (cache shape and dtype).
    spec: slot count and group size.
    params: sampling settings (T and the pad id).
    prompt_len: P.
    num_rows: R, output rows (a one-shot queue's completions, or a persistent engine's
      ring of rows in flight).
    cache_fill: the free slots' cache content (tests poison it with NaN).
  """
  s, steps = spec.num_slots, params.max_new_tokens
  cache = KVCache.zeros(model_config, s, prompt_len + steps)
  if cache_fill != 0.0:
    cache = KVCache(*(jnp.full_like(c, cache_fill) for c in cache))
  cache = KVCache(*(constrain(c, CACHE_AXES) for c in cache))
  # Distinct arrays for every field (no shared buffers): the state is donated whole.
  def zero():
    return jnp.zeros((), jnp.int32)

  def per_slot():
    return jnp.zeros((s,), jnp.int32)

  return EngineState(
      cache=cache, key_mask=jnp.zeros((s, prompt_len + steps), bool),
      num_real=per_slot(), row=jnp.full((s,), FREE, jnp.int32), step=per_slot(),
      last_token=per_slot(), slot_id=per_slot(), slot_limit=per_slot(), next_prompt=zero(),
      tokens=jnp.full((num_rows, steps), params.pad_id, jnp.int32),
      logprobs=jnp.zeros((num_rows, steps), jnp.float32),
      mask=jnp.zeros((num_rows, steps), bool),
      versions=jnp.zeros((num_rows, steps), jnp.int32),
      finished=jnp.zeros((num_rows,), bool), done=zero(),
      stats=EngineStats(zero(), zero(), zero(), zero()))


def _write(buf: jax.Array, rows: jax.Array, cols: jax.Array, values: jax.Array) -> jax.Array:
  """buf[rows[i], cols[i]] = values[i]; rows past the buffer (idle slots) are dropped."""
  return buf.at[rows, cols].set(values.astype(buf.dtype), mode="drop")


def _emit(s: EngineState, rows: jax.Array, column: jax.Array, tokens: jax.Array,
          logprobs: jax.Array, limits: jax.Array, version: jax.Array,
          params: SamplingSettings) -> tuple[EngineState, jax.Array]:
  """Records token `column` of the completions in output `rows` (FREE entries skipped).

  Returns the state with outputs written and a bool per entry: this token ended its
  completion (EOS, or its length budget `limits` reached).
  """
  num_rows = s.tokens.shape[0]
  live = rows != FREE
  target = jnp.where(live, rows, num_rows)  # out of range: dropped
  ended = live & ((tokens == params.eos) | (column + 1 >= limits))
  s = s.replace(tokens=_write(s.tokens, target, column, tokens),
                logprobs=_write(s.logprobs, target, column, logprobs),
                mask=_write(s.mask, target, column, live),
                versions=_write(s.versions, target, column,
                                jnp.broadcast_to(version, tokens.shape)),
                finished=s.finished.at[jnp.where(ended, rows, num_rows)].set(
                    True, mode="drop"),
                done=s.done + jnp.sum(ended, dtype=jnp.int32))
  return s, ended


def _admit(model, s: EngineState, width: int, queue: EngineQueue, rng: jax.Array,
           version: jax.Array, spec: EngineSpec, params: SamplingSettings,
           between: Callable[[EngineState, jax.Array], EngineState]) -> EngineState:
  """Prefills the next `width` prompts of the queue into free slots.

  The caller guarantees `width * n` free slots and `width` prompts left (the queue is
  padded by the widest admission, so the slices below never clamp). With chunked
  prefill, `between(s, allowed)` runs the decoding slots' step between two passes (at
  most one, none unless `allowed`); the admitted prompts take their slots after the
  last pass, so those slots stay free (idle) while the passes run.
  """
  n, steps = spec.group_size, params.max_new_tokens
  prompt_len = queue.tokens.shape[1]
  tokens = jax.lax.dynamic_slice_in_dim(queue.tokens, s.next_prompt, width)  # [w, P]
  mask = jax.lax.dynamic_slice_in_dim(queue.mask, s.next_prompt, width)
  key_mask = completion_key_mask(mask, steps)  # [w, P + T]
  positions = default_positions(mask)  # [w, P]
  cache = KVCache.zeros(model.config, width, prompt_len + steps)
  starts = spec.chunk_starts(prompt_len)
  if len(starts) == 1:
    logits, cache = model.forward_cached(tokens, positions, key_mask, cache, 0,
                                         last_only=True)
  else:
    size = spec.prefill_chunk

    def prefill_pass(i, carry):
      s, cache, _ = carry
      start = jnp.asarray(starts, jnp.int32)[i]
      logits, cache = model.forward_cached(
          jax.lax.dynamic_slice_in_dim(tokens, start, size, axis=1),  # [w, C]
          jax.lax.dynamic_slice_in_dim(positions, start, size, axis=1), key_mask, cache,
          start, last_only=True)
      return between(s, i < len(starts) - 1), cache, logits

    logits = jnp.zeros((width, 1, model.config.vocab_size), jnp.float32)
    s, cache, logits = jax.lax.fori_loop(0, len(starts), prefill_pass, (s, cache, logits))
  logits = logits[:, -1]  # [w, vocab]: left padding puts the last prompt token last

  # Entry j of the admission is sample j % n of prompt j // n; it takes the j-th free
  # slot (free slots in index order).
  free_first = jnp.argsort(s.row != FREE, stable=True)  # [S]
  target = free_first[:width * n]  # [w * n] slot indices
  source = jnp.arange(width * n) // n  # [w * n] prompt within the admission
  out_row, ids, limits = (  # [w * n] each: the admitted completions' entries
      jax.lax.dynamic_slice_in_dim(a, s.next_prompt * n, width * n)
      for a in (queue.rows, queue.ids, queue.limits))

  def put(dst, src, axis):
    # Sample j of every admitted prompt, one scatter per j: the prompts' caches are
    # placed n times without first being repeated into a [w * n, ...] copy.
    for j in range(n):
      slots = target.reshape(width, n)[:, j]
      dst = dst.at[(slice(None),) * axis + (slots,)].set(src.astype(dst.dtype))
    return dst

  if s.cache.unstacked:  # one array per layer (`_run`): [S, kv_heads, P + T, head_dim]
    new_cache = KVCache(*(tuple(constrain(put(d, c[i], 0), CACHE_AXES[1:])
                                for i, d in enumerate(layers))
                          for layers, c in zip(s.cache, cache)))
  else:
    new_cache = KVCache(*(constrain(put(d, c, 1), CACHE_AXES) for d, c in zip(s.cache, cache)))
  first, first_lp = next_tokens(jnp.take(logits, source, axis=0), rng, ids, 0, params)
  # A row may have served an earlier completion (a persistent engine reuses its rows):
  # it starts blank, so nothing of that completion's columns survives past this one's end.
  s = s.replace(
      cache=new_cache, key_mask=put(s.key_mask, key_mask, 0),
      num_real=put(s.num_real, jnp.sum(mask, axis=1, dtype=jnp.int32), 0),
      step=s.step.at[target].set(1), last_token=s.last_token.at[target].set(first),
      slot_id=s.slot_id.at[target].set(ids), slot_limit=s.slot_limit.at[target].set(limits),
      next_prompt=s.next_prompt + width,
      tokens=s.tokens.at[out_row].set(params.pad_id),
      logprobs=s.logprobs.at[out_row].set(0.0), mask=s.mask.at[out_row].set(False),
      versions=s.versions.at[out_row].set(0), finished=s.finished.at[out_row].set(False),
      stats=s.stats.replace(prefills=s.stats.prefills + 1,
                            prefill_rows=s.stats.prefill_rows + width))
  s, ended = _emit(s, out_row, jnp.zeros_like(out_row), first, first_lp, limits, version,
                   params)
  return s.replace(row=s.row.at[target].set(jnp.where(ended, FREE, out_row)))


def _decode(model, s: EngineState, prompt_len: int, rng: jax.Array, version: jax.Array,
            params: SamplingSettings, layer_params) -> EngineState:
  """One decode step of every slot; busy slots record their token, idle ones discard."""
  # The token drawn at step-1 is fed at its own cache column and position. Idle slots
  # compute on whatever their region holds; nothing of theirs is kept.
  fed = jnp.maximum(s.step - 1, 0)  # [S]
  positions = (s.num_real + fed)[:, None]  # [S, 1]
  logits, cache = model.forward_cached(s.last_token[:, None], positions, s.key_mask,
                                       s.cache, prompt_len + fed, layer_params)
  tokens, logprobs = next_tokens(logits[:, 0], rng, s.slot_id, s.step, params)
  busy = s.row != FREE
  s = s.replace(cache=cache)
  s, ended = _emit(s, s.row, s.step, tokens, logprobs, s.slot_limit, version, params)
  return s.replace(
      row=jnp.where(ended, FREE, s.row), step=jnp.where(busy, s.step + 1, s.step),
      last_token=tokens,
      stats=s.stats.replace(decode_steps=s.stats.decode_steps + 1,
                            busy_slot_steps=s.stats.busy_slot_steps
                            + jnp.sum(busy, dtype=jnp.int32)))


def _pad_queue(queue: EngineQueue, spec: EngineSpec) -> EngineQueue:
  """The queue padded by the widest admission, so every dynamic slice stays in range."""
  pad, n = spec.widths[-1], spec.group_size

  def grow(a, rows, value):
    return jnp.concatenate([a, jnp.full((rows,) + a.shape[1:], value, a.dtype)], axis=0)

  return queue.replace(tokens=grow(queue.tokens, pad, 0), mask=grow(queue.mask, pad, True),
                       rows=grow(queue.rows, pad * n, FREE), ids=grow(queue.ids, pad * n, 0),
                       limits=grow(queue.limits, pad * n, 1))


def _run(model, s: EngineState, queue: EngineQueue, rng: jax.Array, version: jax.Array,
         target: jax.Array, spec: EngineSpec, params: SamplingSettings,
         max_steps: jax.Array | None = None) -> EngineState:
  """Admits from `queue` and decodes until `target` completions have ended in this call,
  `max_steps` decode steps have run (None: no bound), or nothing is left to decode
  (every slot idle and the queue admitted)."""
  n, widths = spec.group_size, spec.widths
  prompt_len = queue.tokens.shape[1]
  queue = _pad_queue(queue, spec)
  queue = queue.replace(limits=jnp.minimum(queue.limits, params.max_new_tokens))
  active = current_axis_rules()
  fsdp = active[0].shape.get("fsdp", 1) if active is not None else 1
  layer_params = model.layers.per_layer() if fsdp == 1 else None
  if max_steps is None:
    max_steps = jnp.asarray(np.iinfo(np.int32).max, jnp.int32)

  def going(s: EngineState):
    return (s.done < target) & (s.stats.decode_steps < max_steps)

  def between(s: EngineState, allowed: jax.Array) -> EngineState:
    # One decode step between two prefill passes, as a loop of at most one iteration:
    # a conditional would carry the cache through its idle branch as a copy.
    def once(carry):
      return decode(carry[0]), jnp.zeros((), bool)

    def due(carry):
      return carry[1] & jnp.any(carry[0].row != FREE) & going(carry[0])

    return jax.lax.while_loop(due, once, (s, allowed))[0]

  admits = [functools.partial(_admit, model, width=w, queue=queue, rng=rng, version=version,
                              spec=spec, params=params, between=between)
            for w in widths]

  def room(s: EngineState):
    """Prompts the next admission takes: the widest width the free slots and the queue
    allow, once it reaches the floor; 0 when no admission is due."""
    free = jnp.sum(s.row == FREE, dtype=jnp.int32)
    left = queue.length - s.next_prompt
    fits = jnp.minimum(free // n, left)
    floor = jnp.where(jnp.any(s.row != FREE) & (left >= spec.floor), spec.floor, 1)
    return jnp.where((fits >= floor) & going(s), fits, 0)

  def admit(s: EngineState) -> EngineState:
    # Only called with room >= 1, so every branch admits: no branch passes the state
    # through untouched, which would make XLA copy the KV cache into the result.
    branch = jnp.sum(jnp.asarray(widths) <= room(s)) - 1
    return jax.lax.switch(branch, admits, s)

  def decoding(s: EngineState):
    return jnp.any(s.row != FREE) & (room(s) == 0) & going(s)

  def decode(s: EngineState) -> EngineState:
    return _decode(model, s, prompt_len, rng, version, params, layer_params)

  def cond(s: EngineState):
    return (jnp.any(s.row != FREE) | (s.next_prompt < queue.length)) & going(s)

  def body(s: EngineState) -> EngineState:
    # Admit while admissions are due, then decode until one is due again (or every slot
    # is idle): the decode loop's body is the decode step alone, with no conditional
    # around the cache.
    s = jax.lax.while_loop(lambda s: room(s) > 0, admit, s)
    return jax.lax.while_loop(decoding, decode, s)

  zero = jnp.zeros((), jnp.int32)
  s = s.replace(next_prompt=zero, done=zero, stats=EngineStats(zero, zero, zero, zero))
  if layer_params is not None:
    # Each layer's cache as an array of its own inside the loops (`KVCache.unstack`);
    # the state keeps the stacked form between calls.
    s = s.replace(cache=s.cache.unstack())
  s = jax.lax.while_loop(cond, body, s)
  return s.replace(cache=s.cache.stack())


def run_fn(graphdef: nnx.GraphDef, state: nnx.State, queue_tokens: jax.Array,
           queue_mask: jax.Array, rng: jax.Array, sample_ids: jax.Array,
           limits: jax.Array, spec: EngineSpec, params: SamplingSettings,
           cache_fill: float = 0.0) -> tuple[GenerationOutput, EngineStats]:
  """Decodes the whole queue; pure and jit-able (see `make_engine_fn`).

  Args:
    graphdef, state: `nnx.split` of an LM-head Transformer.
    queue_tokens, queue_mask: [Q, P] left-padded prompts, in admission order.
    rng: base key; completion k's token t uses `token_keys(rng, sample_ids[k], t)`.
    sample_ids: int [Q * n]: completion k is sample k % n of prompt k // n.
    limits: int [Q * n] length budgets (at most T).
    spec, params: static engine and sampling settings.
    cache_fill: initial content of the free slots' cache.

  Returns:
    The [Q * n, T] GenerationOutput (`num_steps` is the number of decode steps run)
    and the EngineStats.
  """
  model = nnx.merge(graphdef, state)
  num_prompts, prompt_len = queue_tokens.shape
  rows = num_prompts * spec.group_size
  queue = EngineQueue(tokens=queue_tokens, mask=queue_mask,
                      length=jnp.asarray(num_prompts, jnp.int32),
                      rows=jnp.arange(rows, dtype=jnp.int32),
                      ids=jnp.asarray(sample_ids, jnp.int32),
                      limits=jnp.asarray(limits, jnp.int32))
  s = init_state(model.config, spec, params, prompt_len, rows, cache_fill)
  s = _run(model, s, queue, rng, jnp.zeros((), jnp.int32), jnp.asarray(rows, jnp.int32),
           spec, params)
  return (GenerationOutput(tokens=s.tokens, logprobs=s.logprobs, mask=s.mask,
                           num_steps=s.stats.decode_steps), s.stats)


def step_fn(graphdef: nnx.GraphDef, state: nnx.State, engine: EngineState,
            queue: EngineQueue, rng: jax.Array, version: jax.Array, target: jax.Array,
            max_steps: jax.Array, release: jax.Array, spec: EngineSpec,
            params: SamplingSettings) -> EngineState:
  """One call of a persistent engine (partial rollouts): pure and jit-able.

  First frees the slots in `release` (bool [S]: completions the caller drops), then
  admits from `queue` and decodes until `target` completions have ended during this
  call, `max_steps` decode steps have run, or nothing is left to decode. Slots still
  decoding at the end stay in the returned state, caches and all, and continue at the
  next call under whatever weights that call gets: every token records the `version`
  that drew it (`versions`). The cache is kept, not recomputed: a token drawn after an
  update comes from the new weights reading the keys and values the earlier tokens got
  from the weights of their time, and its behaviour log-prob is exactly that
  distribution's, which is what the off-policy weight of the decoupled loss divides by.

  Args:
    graphdef, state: `nnx.split` of an LM-head Transformer (this call's weights).
    engine: the state the previous call returned (or `init_state`).
    queue: this call's admissible prompts (`EngineQueue`; rows must be free rows).
    rng: the run's base key (the same at every call: a completion's draws depend on its
      sample id and position only).
    version: int32 []: the policy version of `state`.
    target: int32 []: completions to finish in this call.
    max_steps: int32 []: decode steps this call may run at most (a bound on how long
      the engine goes without looking for newer weights).
    release: bool [S]: slots to free before anything else.
  """
  model = nnx.merge(graphdef, state)
  engine = engine.replace(row=jnp.where(release, FREE, engine.row))
  return _run(model, engine, queue, rng, version, target, spec, params, max_steps)


def make_engine_fn(graphdef: nnx.GraphDef, params: SamplingSettings, spec: EngineSpec,
                   cache_fill: float = 0.0, jit_kwargs: dict[str, Any] | None = None
                   ) -> Callable:
  """Jits `run(state, queue_tokens, queue_mask, rng, sample_ids, limits)`.

  Trace it inside `parallel.logical.axis_rules(mesh, rules)` for the stage's
  activation constraints to apply (the slots take the `batch` axis).
  """
  def run(state, queue_tokens, queue_mask, rng, sample_ids, limits):
    return run_fn(graphdef, state, queue_tokens, queue_mask, rng, sample_ids, limits,
                  spec, params, cache_fill)

  return jax.jit(run, **(jit_kwargs or {}))


def make_step_fn(graphdef: nnx.GraphDef, params: SamplingSettings, spec: EngineSpec
                 ) -> Callable:
  """Jits `step(state, engine, queue, rng, version, target, max_steps, release)`
  (`step_fn`), the engine state donated: its caches are updated in place from call to
  call."""
  def step(state, engine, queue, rng, version, target, max_steps, release):
    return step_fn(graphdef, state, engine, queue, rng, version, target, max_steps,
                   release, spec, params)

  return jax.jit(step, donate_argnums=(1,))


_FNS_CACHE: dict[Any, Callable] = {}


def generate_continuous(model: nnx.Module, prompt_tokens: jax.Array,
                        prompt_mask: jax.Array, params: SamplingSettings, *,
                        rng: jax.Array, num_slots: int, group_size: int = 1,
                        sample_ids: jax.Array | None = None,
                        limits: jax.Array | None = None, max_admit: int | None = None,
                        min_admit: int | None = None, prefill_chunk: int = 0,
                        cache_fill: float = 0.0
                        ) -> tuple[GenerationOutput, EngineStats]:
  """Samples `group_size` completions of every prompt with `num_slots` slots.

  Args:
    model: an LM-head Transformer.
    prompt_tokens, prompt_mask: [Q, P] left-padded prompts (one row per prompt, NOT
      repeated per sample).
    params: sampling settings.
    rng: base key.
    num_slots: S.
    group_size: n; completions of prompt q are rows [q * n, (q + 1) * n) of the output.
    sample_ids: int [Q * n] (default arange): completion k draws with id sample_ids[k].
    limits: optional int [Q * n] length budgets.
    max_admit: widest admission in prompts (default: as many as the slots hold).
    min_admit: narrowest admission while slots are decoding (`EngineSpec`).
    prefill_chunk: prompt columns per prefill pass, the decoding slots stepping between
      two passes (0: the whole prompt in one pass; `EngineSpec`).
    cache_fill: initial content of the free slots' cache (tests poison it with NaN).

  Returns:
    GenerationOutput with [Q * n, T] arrays and the EngineStats.
  """
  if getattr(model, "config", None) is None or model.config.head != "lm":
    raise ValueError("generate_continuous needs a Transformer with head='lm'")
  spec = EngineSpec(num_slots=int(num_slots), group_size=int(group_size),
                    max_admit=max_admit, min_admit=min_admit, prefill_chunk=prefill_chunk)
  prompt_tokens, prompt_mask, _ = check_prompts(prompt_tokens, prompt_mask)
  num_rows = prompt_tokens.shape[0] * spec.group_size
  if sample_ids is None:
    sample_ids = jnp.arange(num_rows, dtype=jnp.int32)
  sample_ids = jnp.asarray(sample_ids, jnp.int32)
  if sample_ids.shape != (num_rows,):
    raise ValueError(f"sample_ids must have shape ({num_rows},) (prompts x group_size), "
                     f"got {sample_ids.shape}")
  if limits is None:
    limits = jnp.full((num_rows,), params.max_new_tokens, jnp.int32)
  limits = jnp.asarray(limits, jnp.int32)
  if limits.shape != (num_rows,):
    raise ValueError(f"limits must have shape ({num_rows},), got {limits.shape}")
  graphdef, state = nnx.split(model)
  key = (graphdef, params, spec, float(cache_fill), current_axis_rules())
  if key not in _FNS_CACHE:
    _FNS_CACHE[key] = make_engine_fn(graphdef, params, spec, cache_fill)
  return _FNS_CACHE[key](state, prompt_tokens, prompt_mask, rng, sample_ids, limits)
