"""One stage's work per tick of the delayed pipeline, and the loop over ticks.

Owns the program each 'pipeline' stage runs inside the pipelined decoder's `shard_map`
(`stage_program`), built from `PipelineSpec`, the static shape of one call.

Slots and loads: the decoder runs M micro-batches of mb rows (S = M * mb slots). The
batch is a queue cut into L = B / mb *loads* of mb consecutive rows. Without refills
(S = B, the default) each micro-batch decodes one load and the work of stage s at tick
t is the closed form of `schedule.delayed_slot`. With S < B, a micro-batch whose rows
are all done (EOS or their length budgets) takes the next load of the queue: its next
pass is that load's prefill, so on a long-tailed length distribution the pipeline
stays full of rows that produce tokens, not only of ticks (`schedule.refill_schedule`
is the pure form of what runs). A load is refilled whole: rows of one micro-batch share
one pass (one cache column, one message), so a row that ends early waits for its
micro-batch's longest; with mb = 1 every slot refills on its own.

Per tick, each stage runs six documented functions over an explicit `LoopState`
(`tick` composes them; `Stage` holds what is read-only for the whole call):
  1. `absorb`: stage 0 takes in the ring message from stage P-1 (the token just
     sampled for some micro-batch and which of its rows are done);
  2. `decide`: stage 0 picks the (micro-batch, load, pass) of this tick from its book
     of which load each micro-batch holds; later stages run what the ring brought;
  3. `compute`: the stage's layers on that slot under `lax.cond` (bubbles, finished
     micro-batches and ticks outside the stage's window skip all compute): stage 0
     embeds the prompt (pass 0) or the micro-batch's latest token, and every layer
     writes its k/v straight into the stage's cache (`stage_layers`);
  4. `sample`: stage P-1 applies the head and draws (`draw_token`: the plain
     sampler's `next_tokens`, i.e. `sampling_logprobs` and
     `token_keys(rng, sample_ids_of_load, pass)`), so tokens equal the plain sampler's
     for the same rng, and writes the token, its log-prob and mask with the plain
     sampler's EOS and budget rules (`record_tokens`); all under one `lax.cond`, so the
     other stages run none of it;
  5. `record`: every stage logs what it ran;
  6. `send`: one message round the ring with `lax.ppermute`: activations and the slot
     to s + 1, and from P-1 the new token (plus row-done flags) back to stage 0. A
     `valid` flag in the message says whether the sender really ran; receivers never
     use invalid payloads, which the NaN-poisoning test checks.

KV cache: `[layers, M, mb, kv_heads, P_len + T, head_dim]` on the logical axes
`CACHE_AXES` (layers -> 'pipeline', kv_heads -> 'tensor' under the generate rules). Inside
a stage it is viewed as `[local_layers * M, mb, ...]` (a free reshape), so layer l of
micro-batch m is row `l * M + m`: the model's per-layer block updates that row in
place, and no tick copies a micro-batch's cache out or back. A refill overwrites the
prompt columns and clears the completion columns of its micro-batch's rows.

Prefill vs decode shapes: without refills the prefill passes all happen in the first
M + P - 1 ticks (stage s prefills at ticks s .. s + M - 1). Those ticks run in a first
segment whose ring messages are `[mb, P_len, embed]` (a decode step inside it uses row
0 only and `lax.cond` picks the prefill or decode compute); every later tick is
decode-only and runs in a second segment with `[mb, 1, embed]` messages
(`split_segments=False` keeps the padded buffer for every tick, for comparison in
`python -m experiments.bench_generate --variants`). With refills a prefill can come at any
tick, so every tick carries the prompt-length buffer; only the message grows, not the
decode's compute.

EOS: a micro-batch whose rows are all done is skipped from its next pass on (or
refilled). The decode segment is a `lax.while_loop` over chunks of `chunk_ticks` ticks
(default W) that exits once the last stage has prefilled every load and every row is
done (one `psum` over 'pipeline' per chunk).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp

from pipe_rlhf_jax.generation import schedule as sched
from pipe_rlhf_jax.generation.sampler import (
  SamplingSettings,
  completion_key_mask,
  next_tokens,
  record_tokens,
)
from pipe_rlhf_jax.models.transformer import KVCache, default_positions

PIPE = "pipeline"
# Executed-schedule marker for ticks the decode loop never reached because every
# micro-batch had already finished (idle ticks that did run are sched.BUBBLE = -1).
NOT_REACHED = -2


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
  """Static shape of one pipelined generation call (hashable: keys the jit cache).

  Attributes:
    num_stages: P, the mesh's 'pipeline' size.
    num_microbatches: M.
    batch, prompt_len: B and P_len of the prompt batch (the queue).
    params: sampling settings (T = params.max_new_tokens).
    chunk_ticks: ticks per early-exit check in the decode segment.
    num_slots: S, rows decoded at once (M micro-batches of S / M rows); 0 = the whole
      batch, one static load per micro-batch. With S < B the batch is a queue of B / mb
      loads and a micro-batch whose rows are all done takes the next load.
    split_segments: use [mb, 1, embed] ring messages once all prefills are done (static
      batches only: with refills a prefill can come at any tick).
    poison_bubbles: debug: idle stages emit NaN activations / garbage tokens, and the
      ring and the KV cache start poisoned, to prove that idle slots and freed cache
      regions never reach the results.
  """

  num_stages: int
  num_microbatches: int
  batch: int
  prompt_len: int
  params: SamplingSettings
  chunk_ticks: int
  num_slots: int = 0
  split_segments: bool = True
  poison_bubbles: bool = False

  @property
  def microbatch(self) -> int:
    """mb, rows per micro-batch (and per load)."""
    return (self.num_slots or self.batch) // self.num_microbatches

  @property
  def num_loads(self) -> int:
    """L, loads of mb consecutive rows the batch is cut into (L = M without refills)."""
    return self.batch // self.microbatch

  @property
  def refills(self) -> bool:
    """More loads than micro-batches: micro-batches are refilled as they finish."""
    return self.num_loads > self.num_microbatches

  @property
  def cache_len(self) -> int:
    """KV cache columns per row: the prompt then one per completion token."""
    return self.prompt_len + self.params.max_new_tokens

  @property
  def width(self) -> int:
    return sched.ring_width(self.num_stages, self.num_microbatches)

  @property
  def total_ticks(self) -> int:
    """Ticks the loop may run at most (the schedule's length without refills)."""
    steps = self.params.max_new_tokens
    if not self.refills:
      return sched.num_ticks(self.num_stages, self.num_microbatches, steps, "delayed")
    return sched.refill_ticks_bound(self.num_stages, self.num_microbatches,
                                    self.num_loads, steps)

  @property
  def segments_split(self) -> bool:
    return self.split_segments and not self.refills

  @property
  def prefill_ticks(self) -> int:
    """Ticks [0, M + P - 1) contain every prefill of a static batch; later ticks are
    decode-only."""
    return min(self.total_ticks, self.num_microbatches + self.num_stages - 1)


class Message(NamedTuple):
  """What one stage sends round the ring each tick.

  h: [mb, length, embed] activations for the next stage (from stages 0..P-2).
  token: int32 [mb] the token just sampled (from stage P-1, for stage 0).
  rows_done: bool [mb] rows of that micro-batch that have emitted EOS (from P-1).
  microbatch, load, step: int32 [] the (micro-batch, load, pass) the sender ran: stage
    0 decides them, every later stage runs what it receives.
  valid: bool [] the sender really ran its scheduled work at this tick.
  """

  h: jax.Array
  token: jax.Array
  rows_done: jax.Array
  microbatch: jax.Array
  load: jax.Array
  step: jax.Array
  valid: jax.Array


class LoopState(NamedTuple):
  """Everything one stage carries from tick to tick (its local blocks).

  The cache is kept flat over (local layer, micro-batch) so a layer's k/v update for
  one micro-batch is a single in-place `dynamic_update_slice` at row
  `layer * M + microbatch`, never a copy of the micro-batch's slice.
  """

  cache: KVCache  # k, v: [local_layers * M, mb, kv_heads, P_len + T, head_dim]
  msg: Message  # received at the end of the previous tick
  last_token: jax.Array  # int32 [M, mb]: stage 0's next input token per micro-batch
  done_rows: jax.Array  # bool [M, mb]: rows of the micro-batch's load that are done
  load_of: jax.Array  # int32 [M]: stage 0's book: the load each micro-batch holds, -1 none
  step_of: jax.Array  # int32 [M]: stage 0's book: the micro-batch's next pass
  next_load: jax.Array  # int32 []: stage 0's book: loads handed out so far
  loads_seen: jax.Array  # int32 []: prefills this stage ran (stage P-1 reads it at exit)
  out_tokens: jax.Array  # int32 [L, mb, T] (filled on stage P-1)
  out_logprobs: jax.Array  # f32 [L, mb, T]
  out_mask: jax.Array  # bool [L, mb, T]
  executed: jax.Array  # int32 [ticks + chunk, 2]: (mb, pass) per tick, -1 idle, -2 not reached
  tick: jax.Array  # int32 []
  all_done: jax.Array  # bool []: every load finished (psum'd per chunk)


class Slot(NamedTuple):
  """One stage's work at one tick: what stage 0 decided, or what the ring brought."""

  microbatch: jax.Array  # int32 [] in [0, M): the cache region and the token buffer
  load: jax.Array  # int32 [] in [0, L): the prompts, keys and output rows
  step: jax.Array  # int32 [] pass: 0 = prefill, k >= 1 = decode of token k
  active: jax.Array  # bool []: the stage runs it


@dataclasses.dataclass(frozen=True)
class Stage:
  """The read-only context of one stage for a whole call (closed over, not carried).

  Built once per call inside the shard_map body; the prompt-derived arrays are
  reshaped per load so a tick only indexes them.
  """

  plan: PipelineSpec
  model: Any  # the merged nnx Transformer (this stage's local layers)
  index: jax.Array  # int32 [] this stage's position on the 'pipeline' axis
  prompts: jax.Array  # int32 [L, mb, P_len]
  positions: jax.Array  # int32 [L, mb, P_len] RoPE positions of the prompt
  key_masks: jax.Array  # bool [L, mb, P_len + T]
  num_real: jax.Array  # int32 [L, mb] real prompt tokens per row
  sample_ids: jax.Array  # int32 [L, mb] global ids: they pick the random keys
  limits: jax.Array  # int32 [L, mb] length budgets
  rng: jax.Array

  @property
  def is_first(self) -> jax.Array:
    return self.index == 0

  @property
  def is_last(self) -> jax.Array:
    return self.index == self.plan.num_stages - 1

  def idle_message(self, length: int) -> Message:
    """The message of a stage that did not run (NaN / -1 / all-done when poisoned)."""
    poison = self.plan.poison_bubbles
    config = self.model.config
    marker = jnp.full((), -1 if poison else 0, jnp.int32)
    return Message(
        h=jnp.full((self.plan.microbatch, length, config.embed_dim),
                   jnp.nan if poison else 0.0, config.compute_dtype),
        token=jnp.full((self.plan.microbatch,), -1 if poison else 0, jnp.int32),
        rows_done=jnp.full((self.plan.microbatch,), poison, bool),
        microbatch=marker, load=marker, step=marker, valid=jnp.zeros((), bool))


# ---------------------------------------------------------------------------
# The parts of one tick, in order: absorb, compute, sample, record, send.
# ---------------------------------------------------------------------------


def absorb(stage: Stage, state: LoopState) -> LoopState:
  """Stage 0 takes in the ring message from stage P-1: the token it sampled at tick
  t - 1 (and which rows of that micro-batch are done), if it really ran."""
  prev = jnp.clip(state.msg.microbatch, 0, stage.plan.num_microbatches - 1)

  def take_in(carry):
    last_token, done_rows = carry
    # With P = 1 stage 0 is the last stage and `sample` already updated its flags.
    done_rows = jnp.where(stage.is_last, done_rows,
                          done_rows.at[prev].set(state.msg.rows_done))
    return last_token.at[prev].set(state.msg.token), done_rows

  last_token, done_rows = jax.lax.cond(stage.is_first & state.msg.valid, take_in,
                                       lambda carry: carry,
                                       (state.last_token, state.done_rows))
  return state._replace(last_token=last_token, done_rows=done_rows)


def decide(stage: Stage, state: LoopState) -> tuple[LoopState, Slot]:
  """The slot this stage runs at this tick.

  Stage 0 visits micro-batch t % W (W = max(M, P), so a micro-batch's token is back
  before its next visit). It runs the micro-batch's next decode pass while some of its
  rows are not done; once all are done (or it never held a load) it prefills the next
  load of the queue into it, if one is left; otherwise it idles. Without refills this
  is exactly the closed form `schedule.delayed_slot` (with finished micro-batches
  skipped); with them it is `schedule.refill_schedule`. Every later stage runs what the
  ring brought from its predecessor at t - 1, so stage s at tick t does what stage 0
  did at t - s.
  """
  plan = stage.plan
  m = state.tick % plan.width
  mb = jnp.minimum(m, plan.num_microbatches - 1).astype(jnp.int32)
  holds = state.load_of[mb] >= 0
  going = holds & ~jnp.all(state.done_rows[mb])
  refill = ~going & (state.next_load < plan.num_loads)
  active = (m < plan.num_microbatches) & (going | refill)
  load = jnp.where(refill, state.next_load, state.load_of[mb])
  step = jnp.where(refill, 0, state.step_of[mb])
  first = Slot(mb, load, step, active)
  msg = state.msg
  ring = Slot(jnp.clip(msg.microbatch, 0, plan.num_microbatches - 1),
              jnp.clip(msg.load, 0, plan.num_loads - 1), jnp.maximum(msg.step, 0), msg.valid)
  slot = Slot(*(jnp.where(stage.is_first, f, r) for f, r in zip(first, ring)))

  book = stage.is_first & active
  take = book & refill
  state = state._replace(
      load_of=state.load_of.at[mb].set(jnp.where(book, load, state.load_of[mb])),
      step_of=state.step_of.at[mb].set(jnp.where(book, step + 1, state.step_of[mb])),
      next_load=state.next_load + take.astype(jnp.int32),
      # A new load's rows start undone (stage P-1 resets its own flags when it prefills).
      done_rows=state.done_rows.at[mb].set(state.done_rows[mb] & ~take))
  return state, slot


def stage_layers(stage: Stage, x: jax.Array, positions: jax.Array, cache: KVCache,
                 slot: Slot, first_slot) -> tuple[jax.Array, KVCache]:
  """This stage's layers on one micro-batch, its k/v written into the cache in place.

  The model's own `Layers.__call__` (so the numbers are the plain sampler's), with each
  layer addressing the flat cache at row `layer * M + microbatch`: one
  `dynamic_update_slice` writes there, and that row is read as the keys/values. Each
  layer takes its kind (sliding window, RoPE base) from its model-wide index.

  Args:
    x: [mb, length, embed] residual stream entering the stage.
    positions: int32 [mb, length] RoPE positions of the queries.
    cache: k, v [local_layers * M, mb, kv_heads, P_len + T, head_dim].
    slot: which micro-batch's cache rows, and which load's key masks, to use.
    first_slot: cache column of the first query; queries occupy [slot, slot + length).

  Returns:
    The residual stream after the stage's layers [mb, length, embed], the cache.
  """
  layers = stage.model.layers
  # The stage's slice of the layer pattern (local / global layers) starts here.
  num_local = layers.q_proj.get_value().shape[0]
  return layers(x, positions, stage.key_masks[slot.load], cache, first_slot,
                cache_stride=stage.plan.num_microbatches, cache_offset=slot.microbatch,
                layer_offset=stage.index * num_local)


def clear_completion_columns(stage: Stage, cache: KVCache, microbatch: jax.Array
                             ) -> KVCache:
  """Zeroes the completion columns [P_len, P_len + T) of a micro-batch's cache rows.

  A refilled micro-batch inherits the region its previous load decoded into; masked
  keys get exactly zero weight, but zero times NaN is NaN, so the region is cleared
  rather than trusted (the poisoned-cache test holds the decoder to this).
  """
  plan = stage.plan
  num_local = cache.k.shape[0] // plan.num_microbatches

  def clear(c):  # [local_layers * M, mb, kv_heads, P_len + T, head_dim]
    zeros = jnp.zeros((1, *c.shape[1:3], plan.params.max_new_tokens, c.shape[4]), c.dtype)
    for layer in range(num_local):
      row = layer * plan.num_microbatches + microbatch
      c = jax.lax.dynamic_update_slice(c, zeros, (row, 0, 0, plan.prompt_len, 0))
    return c

  return KVCache(clear(cache.k), clear(cache.v))


def compute(stage: Stage, state: LoopState, slot: Slot, length: int,
            prefill_possible: bool) -> tuple[KVCache, jax.Array, jax.Array]:
  """The stage's work on (micro-batch, load, pass) under `lax.cond(slot.active)`.

  Stage 0 embeds the load's prompt (pass 0) or the micro-batch's latest token; other
  stages take the received activations. Idle stages skip all compute and emit the idle
  message's activations.

  Args:
    length: ring message length (P_len in a segment that can hold prefills, else 1).
    prefill_possible: this segment can hold pass 0 (then `lax.cond` picks the
      prefill or the decode shape on `step == 0`).

  Returns:
    The cache, the outgoing activations [mb, length, embed], and the residual stream
    at the last query position [mb, 1, embed] (what the head reads).
  """
  plan, model = stage.plan, stage.model
  load = slot.load
  h_in = state.msg.h

  def prefill(cache):
    if plan.refills or plan.poison_bubbles:
      cache = clear_completion_columns(stage, cache, slot.microbatch)
    x = jax.lax.cond(stage.is_first, lambda: model.embed(stage.prompts[load]),
                     lambda: h_in)
    h, cache = stage_layers(stage, x, stage.positions[load], cache, slot, 0)
    # Left padding: the last prompt column is every row's last token.
    return cache, h, h[:, -1:]

  def decode(cache):
    x = jax.lax.cond(stage.is_first,
                     lambda: model.embed(state.last_token[slot.microbatch][:, None]),
                     lambda: h_in[:, :1])
    fed = slot.step - 1  # the token drawn at pass step - 1 sits at its own column
    positions = (stage.num_real[load] + fed)[:, None]  # [mb, 1]
    h, cache = stage_layers(stage, x, positions, cache, slot, plan.prompt_len + fed)
    # A decode step inside a prefill-length segment fills only column 0.
    padded = jnp.pad(h, ((0, 0), (0, length - 1), (0, 0))) if length != 1 else h
    return cache, padded, h

  def work(cache):
    if prefill_possible:
      return jax.lax.cond(slot.step == 0, prefill, decode, cache)
    return decode(cache)

  def skip(cache):
    idle = stage.idle_message(length).h
    return cache, idle, idle[:, :1]

  return jax.lax.cond(slot.active, work, skip, state.cache)


def draw_token(stage: Stage, h_last: jax.Array, slot: Slot
               ) -> tuple[jax.Array, jax.Array]:
  """The last stage's head and draw: token `step` of each row and its log-prob.

  `next_tokens` applies `sampling_logprobs` and draws with
  `token_keys(rng, sample_ids, step)`, exactly as the plain sampler does.

  Args:
    h_last: [mb, 1, embed] residual stream at the last query position.

  Returns:
    int32 tokens [mb] and their f32 log-probs [mb] under the sampling distribution.
  """
  logits = stage.model.head(h_last)[:, 0]  # [mb, vocab]
  return next_tokens(logits, stage.rng, stage.sample_ids[slot.load], slot.step,
                     stage.plan.params)


def sample(stage: Stage, state: LoopState, h_last: jax.Array, slot: Slot
           ) -> tuple[LoopState, jax.Array]:
  """On the last stage when it ran: `draw_token`, then column `step` of the load's
  outputs written with the plain sampler's EOS and length-budget rules
  (`record_tokens`), updating which rows of the micro-batch are done (all undone at a
  prefill: a new load). Every other stage skips all of it (one `lax.cond`: no head
  compute and none of the bookkeeping, which on a shared host is CPU time the busy
  stages lose).

  Returns:
    The state and the tokens int32 [mb] (zeros where nothing was drawn).
  """
  mb, load = slot.microbatch, slot.load
  outputs = (state.out_tokens, state.out_logprobs, state.out_mask, state.done_rows,
             state.loads_seen)  # [L, mb, T] x 3, [M, mb], []

  def draw_and_write(outputs):
    tokens_buf, logprobs_buf, mask_buf, done_rows, seen = outputs
    prefill = slot.step == 0
    done = done_rows[mb] & ~prefill
    tokens, logprobs = draw_token(stage, h_last, slot)
    new = record_tokens(tokens_buf[load], logprobs_buf[load], mask_buf[load], done,
                        slot.step, tokens, logprobs, stage.plan.params,
                        stage.limits[load])
    bufs = tuple(buf.at[load].set(n) for buf, n in zip(outputs[:3], new[:3]))
    return (*bufs, done_rows.at[mb].set(new[3]),
            seen + prefill.astype(jnp.int32)), tokens

  def skip(outputs):
    return outputs, jnp.zeros((stage.plan.microbatch,), jnp.int32)

  outputs, tokens = jax.lax.cond(slot.active & stage.is_last, draw_and_write, skip, outputs)
  out_tokens, out_logprobs, out_mask, done_rows, seen = outputs
  return state._replace(out_tokens=out_tokens, out_logprobs=out_logprobs,
                        out_mask=out_mask, done_rows=done_rows, loads_seen=seen), tokens


def record(state: LoopState, slot: Slot) -> LoopState:
  """Every stage notes what it ran at this tick in the executed schedule."""
  ran = jnp.where(slot.active, jnp.stack([slot.microbatch, slot.step]), sched.BUBBLE)
  return state._replace(executed=state.executed.at[state.tick].set(ran.astype(jnp.int32)))


def send(stage: Stage, state: LoopState, slot: Slot, h_out: jax.Array,
         tokens: jax.Array) -> Message:
  """One ring hop: activations and the slot to stage s + 1, the fresh token (and its
  micro-batch's done rows) from stage P-1 back to stage 0. Returns the message this
  stage receives."""
  poison = stage.plan.poison_bubbles
  run = slot.active
  marker = lambda x: jnp.where(run, x, -1 if poison else 0).astype(jnp.int32)
  msg = Message(h=h_out, token=marker(tokens), rows_done=state.done_rows[slot.microbatch],
                microbatch=marker(slot.microbatch), load=marker(slot.load),
                step=marker(slot.step), valid=run)
  if poison:
    msg = msg._replace(h=jnp.where(run, msg.h, jnp.nan),
                       rows_done=jnp.where(run, msg.rows_done, True))
  num_stages = stage.plan.num_stages
  ring = [(i, (i + 1) % num_stages) for i in range(num_stages)]
  # One collective per tick, not one per field: every ppermute is a rendezvous of
  # all stages, so the fields travel as one byte buffer.
  return _unpack(jax.lax.ppermute(_pack(msg), PIPE, ring), msg)


def _pack(msg: Message) -> jax.Array:
  """The message's fields, bit for bit, as one flat uint8 buffer."""
  as_bytes = lambda x: jax.lax.bitcast_convert_type(
      x.astype(jnp.uint8) if x.dtype == bool else x, jnp.uint8).reshape(-1)
  return jnp.concatenate([as_bytes(x) for x in msg])


def _unpack(buffer: jax.Array, like: Message) -> Message:
  """Inverse of `_pack`, with `like` giving each field's shape and dtype."""
  fields, offset = [], 0
  for x in like:
    if x.dtype == bool:
      fields.append(buffer[offset:offset + x.size].reshape(x.shape).astype(bool))
      offset += x.size
      continue
    width = x.dtype.itemsize
    chunk = buffer[offset:offset + x.size * width]
    shape = (*x.shape, width) if width > 1 else x.shape
    fields.append(jax.lax.bitcast_convert_type(chunk.reshape(shape), x.dtype))
    offset += x.size * width
  return Message(*fields)


def tick(stage: Stage, state: LoopState, length: int, prefill_possible: bool
         ) -> LoopState:
  """One lock-step tick of this stage: absorb, decide, compute, sample, record, send."""
  state = absorb(stage, state)
  state, slot = decide(stage, state)
  cache, h_out, h_last = compute(stage, state, slot, length, prefill_possible)
  state, tokens = sample(stage, state._replace(cache=cache), h_last, slot)
  state = record(state, slot)
  msg = send(stage, state, slot, h_out, tokens)
  return state._replace(msg=msg, tick=state.tick + 1)


# ---------------------------------------------------------------------------
# The tick loops and the per-stage program.
# ---------------------------------------------------------------------------


def run_ticks(stage: Stage, state: LoopState, count: int, length: int,
              prefill_possible: bool) -> LoopState:
  """A plain scan over the next `count` ticks (the prefill segment)."""
  def body(s, _):
    return tick(stage, s, length, prefill_possible), None
  return jax.lax.scan(body, state, None, length=count)[0]


def run_until_done(stage: Stage, state: LoopState, stop: int, length: int,
                   prefill_possible: bool) -> LoopState:
  """while_loop over chunks of `chunk_ticks` ticks up to tick `stop`, leaving once
  every load is done (one psum over 'pipeline' per chunk, not per tick)."""
  def cond(s: LoopState):
    return (s.tick < stop) & ~s.all_done

  def body(s: LoopState):
    s = run_ticks(stage, s, stage.plan.chunk_ticks, length, prefill_possible)
    # Only the last stage knows every load's fate first-hand: it has prefilled all of
    # them and every row of the micro-batches' current loads is done.
    finished = (s.loads_seen == stage.plan.num_loads) & jnp.all(s.done_rows)
    mine = jnp.where(stage.is_last, finished, False).astype(jnp.int32)
    return s._replace(all_done=jax.lax.psum(mine, PIPE) > 0)

  return jax.lax.while_loop(cond, body, state)


def stage_program(graphdef, plan: PipelineSpec, state, prompt_tokens, prompt_mask,
                  sample_ids, limits, rng, cache_k, cache_v):
  """The per-stage program run under shard_map (manual over 'pipeline').

  Args:
    state: the model's parameters (this stage's slice of the layers).
    prompt_tokens, prompt_mask: [B, P_len]; sample_ids, limits: [B]; rng: key.
    cache_k, cache_v: this stage's cache [local_layers, M, mb, kv, P_len + T, hd]
      (zeros, or NaN when poisoned).

  Returns:
    ((tokens, logprobs, mask) each [1, L, mb, T], executed [ticks, 1, 2]).
  """
  num_mb, mb, num_loads = plan.num_microbatches, plan.microbatch, plan.num_loads
  steps, plen = plan.params.max_new_tokens, plan.prompt_len
  per_load = lambda x: x.reshape(num_loads, mb, *x.shape[1:])
  stage = Stage(
      plan=plan, model=nnx.merge(graphdef, state), index=jax.lax.axis_index(PIPE),
      prompts=per_load(prompt_tokens), positions=per_load(default_positions(prompt_mask)),
      key_masks=per_load(completion_key_mask(prompt_mask, steps)),
      num_real=per_load(jnp.sum(prompt_mask.astype(jnp.int32), axis=-1)),
      sample_ids=per_load(sample_ids), limits=per_load(jnp.minimum(limits, steps)),
      rng=rng)
  # Merging (layer, micro-batch) is a free reshape of the contiguous leading dims.
  flat = lambda c: c.reshape(-1, *c.shape[2:])  # [local_layers * M, mb, kv, P_len + T, hd]
  zero = jnp.zeros((), jnp.int32)
  state = LoopState(
      cache=KVCache(flat(cache_k), flat(cache_v)), msg=stage.idle_message(plen),
      last_token=jnp.zeros((num_mb, mb), jnp.int32),
      done_rows=jnp.zeros((num_mb, mb), bool),
      load_of=jnp.full((num_mb,), -1, jnp.int32), step_of=jnp.zeros((num_mb,), jnp.int32),
      next_load=zero, loads_seen=zero,
      out_tokens=jnp.full((num_loads, mb, steps), plan.params.pad_id, jnp.int32),
      out_logprobs=jnp.zeros((num_loads, mb, steps), jnp.float32),
      out_mask=jnp.zeros((num_loads, mb, steps), bool),
      executed=jnp.full((plan.total_ticks + plan.chunk_ticks, 2), NOT_REACHED,
                        jnp.int32),
      tick=zero, all_done=jnp.zeros((), bool))

  if plan.segments_split:
    state = run_ticks(stage, state, plan.prefill_ticks, plen, True)
    if plan.total_ticks > plan.prefill_ticks:
      state = state._replace(msg=state.msg._replace(h=state.msg.h[:, :1]))
      state = run_until_done(stage, state, plan.total_ticks, 1, False)
  else:
    state = run_until_done(stage, state, plan.total_ticks, plen, True)

  executed = state.executed[:plan.total_ticks][:, None]  # [ticks, 1, 2]
  outputs = (state.out_tokens[None], state.out_logprobs[None], state.out_mask[None])
  return outputs, executed
