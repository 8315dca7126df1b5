"""Delayed inter-batch pipelined generation: P layer stages, M micro-batches, one ring.

This module owns the pipelined decoder. The batch is cut into M micro-batches; the
stacked `layers` axis is sharded over the mesh's `pipe` axis, so stage s owns a
contiguous slice of layers; and one `jax.shard_map` (manual over 'pipe' only, so
'tensor' stays automatic and tensor parallelism works inside a stage) runs every
stage in lock-step ticks. The work of stage s at tick t is the closed form of
`schedule.delayed_slot` (the single source of truth): with W = max(M, P) it is
micro-batch (t - s) % W in pass (t - s) // W; pass 0 is the prefill of the whole
prompt, passes 1..T-1 are one-token decode steps, micro-batch ids >= M are bubbles.

Per tick, each stage:
  1. stage 0 absorbs the ring message from stage P-1 (the token just sampled for some
     micro-batch and which of its rows are done) into a per-micro-batch buffer;
  2. runs its layers on (micro-batch, pass) under `lax.cond` (bubbles, finished
     micro-batches and ticks outside the stage's window skip all compute): stage 0
     embeds the prompt (pass 0) or the micro-batch's latest token, every stage updates
     its own KV cache `[M, local_layers, mb, P + T, kv_heads, head_dim]`, and stage
     P-1 applies the head, `sampling_logprobs`, and draws with
     `token_keys(rng, sample_ids_of_mb, pass)` (via `sampler.next_tokens`), so tokens
     equal the plain sampler's for the same rng;
  3. sends one message round the ring with `lax.ppermute`: activations to s + 1, and
     from P-1 the new token (plus row-done flags) back to stage 0. A `valid` flag in the
     message says whether the sender really ran; receivers never use invalid payloads,
     which the NaN-poisoning test checks.

Prefill vs decode shapes: the prefill passes all happen in the first M + P - 1 ticks
(stage s prefills at ticks s .. s + M - 1). Those ticks run in a first segment whose
ring messages are `[mb, P_len, embed]` (a decode step inside it uses row 0 only and
`lax.cond` picks the prefill or decode compute); every later tick is decode-only and
runs in a second segment with `[mb, 1, embed]` messages. The schedule is unchanged;
only the message buffer shrinks (`split_segments=False` keeps the padded buffer for
every tick, for comparison in `experiments/bench_pipeline_generate.py`).

EOS: a micro-batch whose rows are all done is skipped from its next pass on (stage 0
stops it, and the `valid` flag switches the downstream stages off). The decode segment
is a `lax.while_loop` over chunks of `chunk_ticks` ticks (default W) that exits once
the last stage has every micro-batch done (one `psum` over 'pipe' per chunk).

Mesh: 'pipe' (stages) and optionally 'tensor' (inside each stage; the KV cache is
split over kv heads like the k/v projections). Other axes must be 1: data-parallel
copies of a pipeline belong on separate meshes. Parameters are placed with the
generate stage's rules ('layers' -> 'pipe'); the batch must divide into M
micro-batches (ValueError otherwise, no implicit padding).

Known cost: each tick slices its micro-batch's local cache out of the `[M, ...]` cache
and writes it back (the model's `Layers` takes a per-batch cache), i.e. about two extra
passes over that micro-batch's cache per tick, the same order as attention's own read.

The executed schedule (which (micro-batch, pass) each stage really ran per tick; -1
where it idled, -2 on ticks the loop never reached after an early exit) is returned
alongside the output so it can be compared with `schedule.delayed_schedule` and its
utilisation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pipe_rlhf_jax.generation import schedule as sched
from pipe_rlhf_jax.generation.sampler import (GenerationOutput, SamplingParams,
                                              check_prompts, completion_key_mask,
                                              next_tokens, record_tokens)
from pipe_rlhf_jax.models.transformer import (KVCache, default_positions, param_axes)
from pipe_rlhf_jax.parallel.logical import (STAGE_RULES, check_divisible,
                                            is_logical_leaf, tree_shardings)

PIPE = "pipe"
# Executed-schedule marker for ticks the decode loop never reached because every
# micro-batch had already finished (idle ticks that did run are sched.BUBBLE = -1).
NOT_REACHED = -2


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
  """Static shape of one pipelined generation call (hashable: keys the jit cache).

  Attributes:
    num_stages: P, the mesh's 'pipe' size.
    num_microbatches: M.
    batch, prompt_len: B and P_len of the prompt batch.
    params: sampling settings (T = params.max_new_tokens).
    chunk_ticks: ticks per early-exit check in the decode segment.
    split_segments: use [mb, 1, embed] ring messages once all prefills are done.
    poison_bubbles: debug: idle stages emit NaN activations / garbage tokens, and the
      ring starts poisoned, to prove that idle slots never reach the results.
  """

  num_stages: int
  num_microbatches: int
  batch: int
  prompt_len: int
  params: SamplingParams
  chunk_ticks: int
  split_segments: bool = True
  poison_bubbles: bool = False

  @property
  def microbatch(self) -> int:
    return self.batch // self.num_microbatches

  @property
  def width(self) -> int:
    return sched.ring_width(self.num_stages, self.num_microbatches)

  @property
  def total_ticks(self) -> int:
    return sched.num_ticks(self.num_stages, self.num_microbatches,
                           self.params.max_new_tokens, "delayed")

  @property
  def prefill_ticks(self) -> int:
    """Ticks [0, M + P - 1) contain every prefill; later ticks are decode-only."""
    return min(self.total_ticks, self.num_microbatches + self.num_stages - 1)


class Message(NamedTuple):
  """What one stage sends round the ring each tick.

  h: [mb, length, embed] activations for the next stage (from stages 0..P-2).
  token: int32 [mb] the token just sampled (from stage P-1, for stage 0).
  rows_done: bool [mb] rows of that micro-batch that have emitted EOS (from P-1).
  valid: bool [] the sender really ran its scheduled work at this tick.
  """

  h: jax.Array
  token: jax.Array
  rows_done: jax.Array
  valid: jax.Array


class Carry(NamedTuple):
  """Per-stage loop state (all arrays are the stage's local blocks)."""

  cache_k: jax.Array  # [M, local_layers, mb, slots, kv_heads, head_dim]
  cache_v: jax.Array
  msg: Message  # received at the end of the previous tick
  last_token: jax.Array  # int32 [M, mb]: stage 0's next input token per micro-batch
  done_rows: jax.Array  # bool [M, mb]: rows that emitted EOS (as this stage knows)
  out_tokens: jax.Array  # int32 [M, mb, T] (filled on stage P-1)
  out_logprobs: jax.Array  # f32 [M, mb, T]
  out_mask: jax.Array  # bool [M, mb, T]
  executed: jax.Array  # int32 [ticks + chunk, 2]: (mb, pass) per tick, -1 idle, -2 not reached
  tick: jax.Array  # int32 []
  all_done: jax.Array  # bool []: every micro-batch finished (psum'd per chunk)


def _stage_body(graphdef, plan: PipelinePlan, state, prompt_tokens, prompt_mask,
                sample_ids, rng, cache_k, cache_v):
  """The per-stage program run under shard_map (manual over 'pipe')."""
  model = nnx.merge(graphdef, state)
  config = model.config
  params = plan.params
  num_stages, num_mb, mb = plan.num_stages, plan.num_microbatches, plan.microbatch
  steps, plen = params.max_new_tokens, plan.prompt_len
  stage = jax.lax.axis_index(PIPE)
  is_first, is_last = stage == 0, stage == num_stages - 1

  prompts = prompt_tokens.reshape(num_mb, mb, plen)
  pmask = prompt_mask.reshape(num_mb, mb, plen)
  ids = sample_ids.reshape(num_mb, mb)
  key_masks = completion_key_mask(prompt_mask, steps).reshape(num_mb, mb, plen + steps)
  prompt_positions = default_positions(pmask)  # [M, mb, P_len]
  num_real = jnp.sum(pmask.astype(jnp.int32), axis=-1)  # [M, mb]
  embed_dim = config.embed_dim
  dtype = config.compute_dtype
  poison = plan.poison_bubbles

  def idle_message(length):
    fill = jnp.nan if poison else 0.0
    return Message(h=jnp.full((mb, length, embed_dim), fill, dtype),
                   token=jnp.full((mb,), -1 if poison else 0, jnp.int32),
                   rows_done=jnp.full((mb,), poison, bool),
                   valid=jnp.zeros((), bool))

  def compute(ck, cv, h_in, last_tok, mbi, step, length, prefill):
    """Stage work on micro-batch `mbi`, pass `step`: embedding (stage 0) and layers.

    Returns the new cache slices, the outgoing activations [mb, length, embed] and the
    residual stream at the last query position [mb, 1, embed] (for the head).
    """
    if prefill:
      x = jax.lax.cond(is_first, lambda: model.embed(prompts[mbi]), lambda: h_in)
      positions, slot = prompt_positions[mbi], 0
    else:
      x = jax.lax.cond(is_first, lambda: model.embed(last_tok[:, None]),
                       lambda: h_in[:, :1])
      positions = (num_real[mbi] + step - 1)[:, None]
      slot = plen + step - 1
    h, cache = model.layers(x, positions, key_masks[mbi], KVCache(ck, cv), slot)
    h_last = h[:, -1:]  # left padding: the last prompt slot is every row's last token
    if h.shape[1] != length:  # a decode step inside the padded (prefill) segment
      h = jnp.pad(h, ((0, 0), (0, length - h.shape[1]), (0, 0)))
    return cache.k, cache.v, h, h_last

  def tick(carry: Carry, t, length, prefill_possible):
    mbi, step, active = sched.delayed_slot(t, stage, num_stages, num_mb, steps)
    mbi = jnp.clip(mbi, 0, num_mb - 1).astype(jnp.int32)
    step = step.astype(jnp.int32)
    msg = carry.msg

    # 1. Stage 0 takes in the token that stage P-1 sampled at t - 1 (if it ran).
    prev_mb, _, _ = sched.delayed_slot(t - 1, num_stages - 1, num_stages, num_mb, steps)
    prev_mb = jnp.clip(prev_mb, 0, num_mb - 1)
    absorb = is_first & msg.valid
    last_token = jnp.where(absorb, carry.last_token.at[prev_mb].set(msg.token),
                           carry.last_token)
    done_rows = jnp.where(absorb & ~is_last,
                          carry.done_rows.at[prev_mb].set(msg.rows_done),
                          carry.done_rows)

    # 2. Run this stage's slot: stage 0 unless the micro-batch finished; later stages
    # exactly when their predecessor ran the same (micro-batch, pass) at t - 1.
    mb_done = jnp.all(done_rows[mbi])
    run = active & jnp.where(is_first, ~mb_done, msg.valid)

    def work(operands):
      cache_k, cache_v = operands
      ck, cv = cache_k[mbi], cache_v[mbi]
      args = (ck, cv, msg.h, last_token[mbi], mbi, step, length)
      if prefill_possible:
        ck, cv, h, h_last = jax.lax.cond(
            step == 0, lambda: compute(*args, prefill=True),
            lambda: compute(*args, prefill=False))
      else:
        ck, cv, h, h_last = compute(*args, prefill=False)
      return cache_k.at[mbi].set(ck), cache_v.at[mbi].set(cv), h, h_last

    def skip(operands):
      idle = idle_message(length)
      return (*operands, idle.h, idle.h[:, :1])

    cache_k, cache_v, h_out, h_last = jax.lax.cond(
        run, work, skip, (carry.cache_k, carry.cache_v))

    # The last stage applies the head and draws (one copy of it for both pass kinds).
    def draw(h_last):
      logits = model.head(h_last)[:, 0]  # [mb, vocab]
      return next_tokens(logits, rng, ids[mbi], step, params)

    tokens, logprobs = jax.lax.cond(
        run & is_last, draw,
        lambda _: (jnp.zeros((mb,), jnp.int32), jnp.zeros((mb,), jnp.float32)), h_last)

    # The last stage records the draw with the same EOS rules as the plain sampler.
    recorded = record_tokens(carry.out_tokens[mbi], carry.out_logprobs[mbi],
                             carry.out_mask[mbi], done_rows[mbi], step, tokens,
                             logprobs, params)
    commit = run & is_last
    out_tokens, out_logprobs, out_mask, done_rows = (
        jnp.where(commit, buf.at[mbi].set(new), buf) for buf, new in zip(
            (carry.out_tokens, carry.out_logprobs, carry.out_mask, done_rows),
            recorded))

    executed = carry.executed.at[t].set(
        jnp.where(run, jnp.stack([mbi, step]), sched.BUBBLE).astype(jnp.int32))

    # 3. One ring hop: activations to s + 1, the fresh token from P-1 to stage 0.
    out_msg = Message(h=h_out, token=jnp.where(run, tokens, -1 if poison else 0),
                      rows_done=done_rows[mbi], valid=run)
    if poison:
      out_msg = out_msg._replace(h=jnp.where(run, out_msg.h, jnp.nan),
                                 rows_done=jnp.where(run, out_msg.rows_done, True))
    perm = [(i, (i + 1) % num_stages) for i in range(num_stages)]
    out_msg = jax.lax.ppermute(out_msg, PIPE, perm)
    return Carry(cache_k, cache_v, out_msg, last_token, done_rows, out_tokens,
                 out_logprobs, out_mask, executed, t + 1, carry.all_done)

  def run_scan(carry, count, length, prefill_possible):
    """Plain scan over the first `count` ticks: the prefill segment."""
    def body(c, _):
      return tick(c, c.tick, length, prefill_possible), None
    carry, _ = jax.lax.scan(body, carry, None, length=count)
    return carry

  def run_chunked(carry, stop, length, prefill_possible):
    """while_loop over chunks of ticks, leaving once every micro-batch is done."""
    chunk = plan.chunk_ticks

    def cond(c: Carry):
      return (c.tick < stop) & ~c.all_done

    def body(c: Carry):
      def one(c, _):
        return tick(c, c.tick, length, prefill_possible), None
      c, _ = jax.lax.scan(one, c, None, length=chunk)
      # Only the last stage knows every micro-batch's fate first-hand.
      mine = jnp.where(is_last, jnp.all(c.done_rows), False).astype(jnp.int32)
      return c._replace(all_done=jax.lax.psum(mine, PIPE) > 0)

    return jax.lax.while_loop(cond, body, carry)

  carry = Carry(
      cache_k=cache_k, cache_v=cache_v, msg=idle_message(plen),
      last_token=jnp.zeros((num_mb, mb), jnp.int32),
      done_rows=jnp.zeros((num_mb, mb), bool),
      out_tokens=jnp.full((num_mb, mb, steps), params.pad_id, jnp.int32),
      out_logprobs=jnp.zeros((num_mb, mb, steps), jnp.float32),
      out_mask=jnp.zeros((num_mb, mb, steps), bool),
      executed=jnp.full((plan.total_ticks + plan.chunk_ticks, 2), NOT_REACHED,
                        jnp.int32),
      tick=jnp.zeros((), jnp.int32), all_done=jnp.zeros((), bool))

  if plan.split_segments:
    carry = run_scan(carry, plan.prefill_ticks, plen, True)
    if plan.total_ticks > plan.prefill_ticks:
      msg = carry.msg
      carry = carry._replace(msg=msg._replace(h=msg.h[:, :1]))
      carry = run_chunked(carry, plan.total_ticks, 1, False)
  else:
    carry = run_chunked(carry, plan.total_ticks, plen, True)

  executed = carry.executed[:plan.total_ticks][:, None]  # [ticks, 1, 2]
  outputs = (carry.out_tokens[None], carry.out_logprobs[None], carry.out_mask[None])
  return outputs, executed


def _pipe_only_spec(axes) -> P:
  """PartitionSpec naming only 'pipe' (on the stacked `layers` dim)."""
  return P(*(PIPE if name == "layers" else None for name in axes))


@functools.lru_cache(maxsize=64)
def _build(graphdef, plan: PipelinePlan, mesh, state_specs_key, cache_shape,
           cache_dtype):
  """Jits the whole pipelined generation for one (model structure, plan, mesh)."""
  state_specs = state_specs_key.tree
  # The cache lives where its stage is: layers over 'pipe', kv heads over 'tensor'
  # (the model's own k/v projections are split that way).
  tensor = mesh.shape.get("tensor", 1)
  kv_axis = "tensor" if tensor > 1 and cache_shape[4] % tensor == 0 else None
  cache_sharding = NamedSharding(mesh, P(None, PIPE, None, None, kv_axis, None))
  cache_spec = P(None, PIPE)

  body = functools.partial(_stage_body, graphdef, plan)
  mapped = jax.shard_map(
      body, mesh=mesh,
      in_specs=(state_specs, P(), P(), P(), P(), cache_spec, cache_spec),
      out_specs=((P(PIPE), P(PIPE), P(PIPE)), P(None, PIPE)),
      axis_names=frozenset({PIPE}), check_vma=False)

  def run(state, prompt_tokens, prompt_mask, sample_ids, rng):
    zeros = lambda: jax.lax.with_sharding_constraint(
        jnp.zeros(cache_shape, cache_dtype), cache_sharding)
    (tokens, logprobs, mask), executed = mapped(
        state, prompt_tokens, prompt_mask, sample_ids, rng, zeros(), zeros())
    # Only the last stage's buffers hold results: [P, M, mb, T] -> [B, T].
    batch = plan.batch
    tokens, logprobs, mask = (x[-1].reshape(batch, -1) for x in (tokens, logprobs, mask))
    num_steps = jnp.max(jnp.sum(mask.astype(jnp.int32), axis=1))
    return GenerationOutput(tokens=tokens, logprobs=logprobs, mask=mask,
                            num_steps=num_steps), executed

  return jax.jit(run)


class _SpecsKey:
  """Hashable wrapper for the per-parameter shard_map specs (by model structure)."""

  def __init__(self, tree, key):
    self.tree, self._key = tree, key

  def __hash__(self):
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, _SpecsKey) and self._key == other._key


def _resolve_model(model, args):
  """Accepts `model` as an nnx Module, a (graphdef, state) pair, or a GraphDef whose
  state is the first positional argument after it (the generate stage's form)."""
  if isinstance(model, nnx.GraphDef):
    if not args:
      raise ValueError("pipelined_generate(graphdef, state, ...) needs the state")
    return model, args[0], args[1:]
  if isinstance(model, tuple) and len(model) == 2:
    return model[0], model[1], args
  if isinstance(model, nnx.Module):
    graphdef, state = nnx.split(model)
    return graphdef, state, args
  raise TypeError(
      "model must be an nnx Transformer, a (graphdef, state) pair, or a GraphDef "
      f"followed by its state; got {type(model).__name__}")


class PreparedPipeline(NamedTuple):
  """A validated, jitted pipelined generation and its arguments.

  `fn(*args)` returns (GenerationOutput, executed schedule); `fn.lower(*args)` gives
  the compiled program for inspection or timing.
  """

  fn: Any
  args: tuple
  plan: PipelinePlan


def pipelined_generate(model, *args, mesh, num_microbatches: int, rng: jax.Array,
                       temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                       eos_id: int | None = None, pad_id: int = 0,
                       sample_ids: jax.Array | None = None, rules=None,
                       chunk_ticks: int | None = None, split_segments: bool = True,
                       poison_bubbles: bool = False
                       ) -> tuple[GenerationOutput, jax.Array]:
  """Generates with the delayed inter-batch pipeline over the mesh's 'pipe' axis.

  Call forms (positional arguments after `model`):
    pipelined_generate(model, prompt_tokens, prompt_mask, max_new_tokens, ...)
    pipelined_generate((graphdef, state), prompt_tokens, prompt_mask, T, ...)
    pipelined_generate(graphdef, state, prompt_tokens, prompt_mask, params, ...)
  where the length argument may also be a `SamplingParams` (then it supplies
  temperature / top-k / top-p / EOS / pad and those keywords must stay default).

  Args:
    model: see above; an LM-head Transformer.
    mesh: a Mesh with a 'pipe' axis (P stages); a 'tensor' axis shards every stage's
      heads / mlp / vocab automatically; other axes must have size 1.
    num_microbatches: M >= 1, must divide the batch (no implicit padding).
    rng, temperature, top_k, top_p, eos_id, pad_id, sample_ids: exactly as for
      `sampler.generate`; the result is token-identical to it.
    rules: logical axis rules for the parameter layout (default: the generate
      stage's); 'layers' must map to 'pipe'.
    chunk_ticks: ticks between early-exit checks (default W = max(M, P)).
    split_segments: shrink ring messages to one token once all prefills are done.
    poison_bubbles: debug switch (see PipelinePlan).

  Returns:
    (GenerationOutput [B, T], executed schedule int32 [ticks, P, 2] of the
    (micro-batch, pass) each stage ran per tick, -1 where it idled and -2 on ticks
    never reached because the loop exited early once every row was done).

  Raises:
    ValueError: before compiling, for a mesh without 'pipe', a pipe size not dividing
      num_layers, M < 1, M not dividing the batch, or other bad settings.
  """
  prepared = prepare_pipelined(
      model, *args, mesh=mesh, num_microbatches=num_microbatches, rng=rng,
      temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id, pad_id=pad_id,
      sample_ids=sample_ids, rules=rules, chunk_ticks=chunk_ticks,
      split_segments=split_segments, poison_bubbles=poison_bubbles)
  return prepared.fn(*prepared.args)


def prepare_pipelined(model, *args, mesh, num_microbatches: int, rng: jax.Array,
                      temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                      eos_id: int | None = None, pad_id: int = 0,
                      sample_ids: jax.Array | None = None, rules=None,
                      chunk_ticks: int | None = None, split_segments: bool = True,
                      poison_bubbles: bool = False) -> PreparedPipeline:
  """Validates everything and places the parameters, without running.

  Same arguments as `pipelined_generate`; returns the jitted function (cached per
  model structure, plan and mesh) with its arguments, so callers can time compilation
  separately or inspect the lowered program.
  """
  graphdef, state, args = _resolve_model(model, args)
  if len(args) != 3:
    raise TypeError("expected prompt_tokens, prompt_mask and max_new_tokens (or "
                    f"SamplingParams) after the model, got {len(args)} arguments")
  prompt_tokens, prompt_mask, length = args
  if isinstance(length, SamplingParams):
    params = length
    given = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id,
                 pad_id=pad_id)
    defaults = dict(temperature=1.0, top_k=0, top_p=1.0, eos_id=None, pad_id=0)
    clash = sorted(k for k in given if given[k] != defaults[k])
    if clash:
      raise ValueError(f"{clash} were given as keywords together with SamplingParams; "
                       "set them in the SamplingParams instead")
  else:
    params = SamplingParams(max_new_tokens=int(length), temperature=float(temperature),
                            top_k=int(top_k), top_p=float(top_p), eos_id=eos_id,
                            pad_id=int(pad_id))
  if PIPE not in mesh.shape:
    raise ValueError(f"mesh has axes {tuple(mesh.shape)}; pipelined generation needs a "
                     "'pipe' axis (build it with parallel.mesh.make_mesh)")
  others = {k: v for k, v in mesh.shape.items() if k not in (PIPE, "tensor") and v > 1}
  if others:
    raise ValueError(
        f"mesh axes {others} must be 1 for pipelined generation (only 'pipe' and "
        "'tensor' are used inside the pipeline); run data-parallel copies of the "
        "pipeline on separate meshes instead")
  num_stages = int(mesh.shape[PIPE])
  prompt_tokens, prompt_mask, sample_ids = check_prompts(prompt_tokens, prompt_mask,
                                                         sample_ids)
  batch, prompt_len = prompt_tokens.shape
  abstract = nnx.merge(graphdef, state)
  config = abstract.config
  if config.head != "lm":
    raise ValueError("pipelined_generate needs a Transformer with head='lm'")
  sched.validate_pipeline_config(config.num_layers, num_stages, num_microbatches, batch,
                                 field_prefix="generate")
  rules = tuple(rules) if rules is not None else STAGE_RULES["generate"]
  if dict(rules).get("layers") != PIPE:
    raise ValueError("rules must map 'layers' to 'pipe' for pipelined generation, "
                     f"got layers -> {dict(rules).get('layers')!r}")
  width = sched.ring_width(num_stages, num_microbatches)
  chunk = width if chunk_ticks is None else int(chunk_ticks)
  if chunk < 1:
    raise ValueError(f"chunk_ticks must be >= 1, got {chunk_ticks!r}")

  axes = param_axes(abstract)
  state = nnx.state(abstract)
  check_divisible(state, axes, mesh, rules)
  state = jax.device_put(state, tree_shardings(mesh, axes, rules))
  specs = jax.tree.map(_pipe_only_spec, axes, is_leaf=is_logical_leaf)
  key = (graphdef, jax.tree.structure(state),
         tuple(str(s) for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))))
  plan = PipelinePlan(num_stages=num_stages, num_microbatches=int(num_microbatches),
                      batch=batch, prompt_len=prompt_len, params=params,
                      chunk_ticks=chunk, split_segments=bool(split_segments),
                      poison_bubbles=bool(poison_bubbles))
  cache_shape = (plan.num_microbatches, config.num_layers, plan.microbatch,
                 prompt_len + params.max_new_tokens, config.num_kv_heads,
                 config.head_dim)
  fn = _build(graphdef, plan, mesh, _SpecsKey(specs, key), cache_shape,
              config.compute_dtype)
  return PreparedPipeline(fn, (state, prompt_tokens, prompt_mask, sample_ids, rng), plan)
