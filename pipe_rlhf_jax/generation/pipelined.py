"""Delayed inter-batch pipelined generation: P layer stages, M micro-batches, one ring.

This module owns the pipelined decoder. The batch is cut into M micro-batches; the
stacked `layers` axis is sharded over the mesh's `pipeline` axis, so stage s owns a
contiguous slice of layers; and one `jax.shard_map` (manual over 'pipeline' only, so
'tensor' stays automatic and tensor parallelism works inside a stage) runs every
stage in lock-step ticks. The work of stage s at tick t is the closed form of
`schedule.delayed_slot` (the single source of truth): with W = max(M, P) it is
micro-batch (t - s) % W in pass (t - s) // W; pass 0 is the prefill of the whole
prompt, passes 1..T-1 are one-token decode steps, micro-batch ids >= M are bubbles.

The tick machinery (the five parts of a tick, the carried `LoopState`, the flat KV
cache, the prefill and decode segments, the early exit on EOS) lives in
`pipeline_ticks.py`; this module owns the program around it: validating a call, the
parameter and cache layouts, the `shard_map` over 'pipeline', and the jit cache.

Mesh: 'pipe' (stages) and optionally 'tensor' (inside each stage; the KV cache is
split over kv heads like the k/v projections). Other axes must be 1: data-parallel
copies of a pipeline belong on separate meshes. Parameters are placed with the
generate stage's rules ('layers' -> 'pipeline'); the batch must divide into M
micro-batches (ValueError otherwise, no implicit padding).

The executed schedule (which (micro-batch, pass) each stage really ran per tick; -1
where it idled, -2 on ticks the loop never reached after an early exit) is returned
alongside the output so it can be compared with `schedule.delayed_schedule` and its
utilisation.

Entry point: `pipelined_generate` (`prepare_pipelined` is its validate-and-look-up
half, for callers that time compilation). Everything that depends only on the model
structure, mesh and rules (config, parameter shardings and shard_map specs) and on the
static plan (the jitted shard_map program) is built once and cached under those keys.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from pipe_rlhf_jax.generation import schedule as sched
from pipe_rlhf_jax.generation.pipeline_ticks import NOT_REACHED, PIPE, PipelineSpec, stage_program  # noqa: F401 (public names)
from pipe_rlhf_jax.generation.sampler import GenerationOutput, SamplingSettings, check_prompts
from pipe_rlhf_jax.models.transformer import param_axes
from pipe_rlhf_jax.parallel.logical import (
  STAGE_RULES,
  check_divisible,
  is_logical_leaf,
  logical_sharding,
  logical_to_spec,
  tree_shardings,
)

# Logical axes of the pipeline's KV cache (k and v alike), resolved by the same rules
# as the parameters: 'layers' -> 'pipeline' keeps each stage's cache with its layers and
# 'kv_heads' -> 'tensor' splits it like the k/v projections.
# [layers, M, mb, kv_heads, slots, head_dim]: head-major, as `models.transformer.KVCache`.
CACHE_AXES = ("layers", "microbatches", "cache_batch", "kv_heads", "cache_length",
              "head_dim")


def _pipe_only_spec(axes) -> P:
  """PartitionSpec naming only 'pipe' (on the stacked `layers` dim)."""
  return P(*(PIPE if name == "layers" else None for name in axes))


class _Layout(NamedTuple):
  """What a (model structure, mesh, rules) fixes, computed once per key: the model
  config, the parameters' logical axes, their shardings and their shard_map specs."""

  config: Any
  axes: Any
  shardings: Any
  specs: Any


_LAYOUTS: dict[Any, _Layout] = {}


def _layout(graphdef, state, mesh, rules) -> _Layout:
  """The `_Layout` of (graphdef, mesh, rules), merged and derived only on a miss."""
  key = (graphdef, mesh, rules)
  if key not in _LAYOUTS:
    abstract = nnx.merge(graphdef, state)
    axes = param_axes(abstract)
    _LAYOUTS[key] = _Layout(
        config=abstract.config, axes=axes, shardings=tree_shardings(mesh, axes, rules),
        specs=jax.tree.map(_pipe_only_spec, axes, is_leaf=is_logical_leaf))
  return _LAYOUTS[key]


@functools.lru_cache(maxsize=64)
def _build(graphdef, plan: PipelineSpec, mesh, rules):
  """Jits the whole pipelined generation for one (model structure, plan, mesh, rules).

  Cached, so repeated calls with the same static settings reuse one jitted (and,
  after the first call, compiled) function.
  """
  layout = _LAYOUTS[(graphdef, mesh, rules)]
  config = layout.config
  cache_shape = (config.num_layers, plan.num_microbatches, plan.microbatch,
                 config.num_kv_heads, plan.cache_len, config.head_dim)
  cache_sharding = logical_sharding(mesh, CACHE_AXES, rules)
  cache_spec = _pipe_only_spec(CACHE_AXES)

  mapped = jax.shard_map(
      functools.partial(stage_program, graphdef, plan), mesh=mesh,
      in_specs=(layout.specs, P(), P(), P(), P(), P(), cache_spec, cache_spec),
      out_specs=((P(PIPE), P(PIPE), P(PIPE)), P(None, PIPE)),
      axis_names=frozenset({PIPE}), check_vma=False)

  def run(state, prompt_tokens, prompt_mask, sample_ids, limits, rng):
    # Created inside the jit, so the cache is never a host-visible buffer.
    fill = jnp.nan if plan.poison_bubbles else 0.0
    blank = lambda: jax.lax.with_sharding_constraint(
        jnp.full(cache_shape, fill, config.compute_dtype), cache_sharding)
    (tokens, logprobs, mask), executed = mapped(
        state, prompt_tokens, prompt_mask, sample_ids, limits, rng, blank(), blank())
    # Only the last stage's buffers hold results: [P, L, mb, T] -> [B, T].
    tokens, logprobs, mask = (x[-1].reshape(plan.batch, -1)
                              for x in (tokens, logprobs, mask))
    num_steps = jnp.max(jnp.sum(mask.astype(jnp.int32), axis=1))
    return GenerationOutput(tokens=tokens, logprobs=logprobs, mask=mask,
                            num_steps=num_steps), executed

  return jax.jit(run)


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
  plan: PipelineSpec


def pipelined_generate(model, *args, mesh, num_microbatches: int, rng: jax.Array,
                       temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                       eos_id: int | None = None, pad_id: int = 0,
                       sample_ids: jax.Array | None = None, rules=None,
                       chunk_ticks: int | None = None, num_slots: int = 0,
                       limits: jax.Array | None = None, split_segments: bool = True,
                       poison_bubbles: bool = False
                       ) -> tuple[GenerationOutput, jax.Array]:
  """Generates with the delayed inter-batch pipeline over the mesh's 'pipeline' axis.

  Call forms (positional arguments after `model`):
    pipelined_generate(model, prompt_tokens, prompt_mask, max_new_tokens, ...)
    pipelined_generate((graphdef, state), prompt_tokens, prompt_mask, T, ...)
    pipelined_generate(graphdef, state, prompt_tokens, prompt_mask, params, ...)
  where the length argument may also be a `SamplingSettings` (then it supplies
  temperature / top-k / top-p / EOS / pad and those keywords must stay default).

  Args:
    model: see above; an LM-head Transformer.
    mesh: a Mesh with a 'pipeline' axis (P stages); a 'tensor' axis shards every stage's
      heads / mlp / vocab automatically; other axes must have size 1.
    num_microbatches: M >= 1, must divide the batch (no implicit padding).
    rng, temperature, top_k, top_p, eos_id, pad_id, sample_ids: exactly as for
      `sampler.generate`; the result is token-identical to it.
    rules: logical axis rules for the parameter layout (default: the generate
      stage's); 'layers' must map to 'pipeline'.
    chunk_ticks: ticks between early-exit checks (default W = max(M, P)).
    num_slots: S, rows decoded at once (0: the whole batch). With S < B the batch is a
      queue of loads of S / M rows, and a micro-batch whose rows are all done is
      refilled with the next load (continuous batching at micro-batch grain); every
      completion still equals the plain sampler's for its sample id. S must be a
      multiple of M, and S / M must divide B.
    limits: optional int [B] per-row length budgets (at most T), as for `generate`.
    split_segments: shrink ring messages to one token once all prefills are done
      (static batches).
    poison_bubbles: debug switch (see PipelineSpec).

  Returns:
    (GenerationOutput [B, T], executed schedule int32 [ticks, P, 2] of the
    (micro-batch, pass) each stage ran per tick, -1 where it idled and -2 on ticks
    never reached because the loop exited early once every row was done).

  Raises:
    ValueError: before compiling, for a mesh without 'pipeline', a pipeline size not dividing
      num_layers, M < 1, M not dividing the batch (or the slots), or other bad settings.
  """
  prepared = prepare_pipelined(
      model, *args, mesh=mesh, num_microbatches=num_microbatches, rng=rng,
      temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id, pad_id=pad_id,
      sample_ids=sample_ids, rules=rules, chunk_ticks=chunk_ticks, num_slots=num_slots,
      limits=limits, split_segments=split_segments, poison_bubbles=poison_bubbles)
  return prepared.fn(*prepared.args)


def prepare_pipelined(model, *args, mesh, num_microbatches: int, rng: jax.Array,
                      temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                      eos_id: int | None = None, pad_id: int = 0,
                      sample_ids: jax.Array | None = None, rules=None,
                      chunk_ticks: int | None = None, num_slots: int = 0,
                      limits: jax.Array | None = None, split_segments: bool = True,
                      poison_bubbles: bool = False) -> PreparedPipeline:
  """Validates everything and places the parameters, without running.

  Same arguments as `pipelined_generate`; returns the jitted function (cached per
  model structure, plan and mesh) with its arguments, so callers can time compilation
  separately or inspect the lowered program.
  """
  graphdef, state, args = _resolve_model(model, args)
  if len(args) != 3:
    raise TypeError("expected prompt_tokens, prompt_mask and max_new_tokens (or "
                    f"SamplingSettings) after the model, got {len(args)} arguments")
  prompt_tokens, prompt_mask, length = args
  if isinstance(length, SamplingSettings):
    params = length
    given = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id,
                 pad_id=pad_id)
    defaults = dict(temperature=1.0, top_k=0, top_p=1.0, eos_id=None, pad_id=0)
    clash = sorted(k for k in given if given[k] != defaults[k])
    if clash:
      raise ValueError(f"{clash} were given as keywords together with SamplingSettings; "
                       "set them in the SamplingSettings instead")
  else:
    params = SamplingSettings(max_new_tokens=int(length), temperature=float(temperature),
                            top_k=int(top_k), top_p=float(top_p), eos_id=eos_id,
                            pad_id=int(pad_id))
  if PIPE not in mesh.shape:
    raise ValueError(f"mesh has axes {tuple(mesh.shape)}; pipelined generation needs a "
                     "'pipeline' axis (build it with parallel.mesh.make_mesh)")
  others = {k: v for k, v in mesh.shape.items() if k not in (PIPE, "tensor") and v > 1}
  if others:
    raise ValueError(
        f"mesh axes {others} must be 1 for pipelined generation (only 'pipeline' and "
        "'tensor' are used inside the pipeline); run data-parallel copies of the "
        "pipeline on separate meshes instead")
  num_stages = int(mesh.shape[PIPE])
  prompt_tokens, prompt_mask, sample_ids = check_prompts(prompt_tokens, prompt_mask,
                                                         sample_ids)
  batch, prompt_len = prompt_tokens.shape
  rules = tuple((name, tuple(axes) if isinstance(axes, list) else axes)
                for name, axes in (rules if rules is not None else STAGE_RULES["generate"]))
  if dict(rules).get("layers") != PIPE:
    raise ValueError("rules must map 'layers' to 'pipeline' for pipelined generation, "
                     f"got layers -> {dict(rules).get('layers')!r}")
  layout = _layout(graphdef, state, mesh, rules)
  config = layout.config
  if config.head != "lm":
    raise ValueError("pipelined_generate needs a Transformer with head='lm'")
  sched.validate_pipeline_config(config.num_layers, num_stages, num_microbatches, batch,
                                 field_prefix="generate")
  num_slots = _check_slots(num_slots, num_microbatches, batch)
  if limits is None:
    limits = jnp.full((batch,), params.max_new_tokens, jnp.int32)
  limits = jnp.asarray(limits, jnp.int32)
  if limits.shape != (batch,):
    raise ValueError(f"limits must be an int array of shape ({batch},) (one length budget "
                     f"per row), got shape {limits.shape}")
  check_divisible(state, layout.axes, mesh, rules)
  logical_to_spec(CACHE_AXES, rules, mesh)  # every cache axis has a rule
  width = sched.ring_width(num_stages, num_microbatches)
  chunk = width if chunk_ticks is None else int(chunk_ticks)
  if chunk < 1:
    raise ValueError(f"chunk_ticks must be >= 1, got {chunk_ticks!r}")

  plan = PipelineSpec(num_stages=num_stages, num_microbatches=int(num_microbatches),
                      batch=batch, prompt_len=prompt_len, params=params,
                      chunk_ticks=chunk, num_slots=num_slots,
                      split_segments=bool(split_segments),
                      poison_bubbles=bool(poison_bubbles))
  # A no-op when the parameters already live where the rules put them.
  state = jax.device_put(state, layout.shardings)
  fn = _build(graphdef, plan, mesh, rules)
  return PreparedPipeline(fn, (state, prompt_tokens, prompt_mask, sample_ids, limits, rng),
                          plan)


def _check_slots(num_slots, num_microbatches: int, batch: int) -> int:
  """`num_slots` resolved: 0 (or the batch) for one static load per micro-batch, else a
  multiple of M whose micro-batch size divides the batch (ValueError naming the fix)."""
  if isinstance(num_slots, bool) or not isinstance(num_slots, (int, np.integer)) or (
      num_slots < 0):
    raise ValueError(f"generate.num_slots must be an int >= 0, got {num_slots!r}")
  if num_slots == 0 or num_slots >= batch:
    return 0
  if num_slots % num_microbatches:
    raise ValueError(
        f"generate.num_slots = {num_slots} is not a multiple of generate.num_microbatches "
        f"= {num_microbatches}: each micro-batch holds num_slots / num_microbatches rows")
  rows = num_slots // num_microbatches
  if batch % rows:
    ok = [m * d for d in range(1, batch + 1) if batch % d == 0
          for m in (num_microbatches,) if m * d < batch]
    raise ValueError(
        f"generate.num_slots = {num_slots} gives micro-batches of {rows} rows, which do "
        f"not divide the batch of {batch} rows into loads; use num_slots in {ok}")
  return int(num_slots)
