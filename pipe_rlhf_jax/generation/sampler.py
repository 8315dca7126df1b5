"""The plain KV-cache sampler: jitted prefill, then a `lax.while_loop` decode.

This module owns non-pipelined autoregressive generation for one batch:
- `SamplingSettings`: the static knobs (length, temperature / top-k / top-p, EOS, pad).
- `next_tokens` / `record_tokens`: the per-step draw and the EOS bookkeeping; the
  pipelined decoder calls the same two functions, so both decoders agree bit for bit.
- `prefill_fn` / `decode_fn`: pure, jit-able building blocks over `(graphdef, state)`;
  `make_generate_fns` jits them (optionally with explicit shardings of a stage's mesh,
  the decode state donated so the KV cache and output buffers are updated in place).
- `generate`: the convenience wrapper used by tests, benchmarks and the generate stage.

Layout (see `ppo/types.py`): prompts are left-padded `[B, P]`, completions right-padded
`[B, T]`. The KV cache has `P + T` slots: the prompt fills slots `[0, P)` in the
prefill, and completion token `t` is written to slot `P + t` when it is fed back. All
rows write the same slot at each step, which the model's slot-causal mask relies on.
Completion token `t` of a row with `n` real prompt tokens has RoPE position `n + t`,
exactly what `default_positions` gives on the concatenated `[prompt | completion]`, so a
full forward pass over the result reproduces the recorded log-probs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from flax import nnx, struct
import jax
import jax.numpy as jnp
import numpy as np

from pipe_rlhf_jax.generation.sampling import draw, token_keys
from pipe_rlhf_jax.models.transformer import CACHE_AXES, KVCache, default_positions
from pipe_rlhf_jax.parallel.logical import constrain, current_axis_rules

NO_EOS = -1  # internal stand-in for eos_id=None: no sampled token ever equals it


@struct.dataclass
class GenerationOutput:
  """Result of generating one batch.

  Attributes:
    tokens: int32 [B, T]; `pad_id` after a row's EOS (and after an early stop).
    logprobs: f32 [B, T]; log-prob of the chosen token under the POLICY
      distribution softmax(logits / temperature), top-k / top-p NOT applied (they
      only filter the draw; see `sampling.py`); 0 on padding.
    mask: bool [B, T]; True on generated tokens, EOS included.
    num_steps: int32 []; completion positions actually decoded (< T when every row
      emitted EOS early).
  """

  tokens: jax.Array
  logprobs: jax.Array
  mask: jax.Array
  num_steps: jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
  """Static generation settings (hashable: they key the jit caches).

  Attributes:
    max_new_tokens: T, completion length (buffer width and decode-step bound).
    temperature: > 0 samples; 0 is greedy (argmax).
    top_k: keep the k most likely tokens (0 = all).
    top_p: nucleus mass in (0, 1] (1 = all).
    eos_id: token that ends a row, or None to always decode T tokens.
    pad_id: token written after EOS.
  """

  max_new_tokens: int
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  eos_id: int | None = None
  pad_id: int = 0

  def __post_init__(self):
    if (isinstance(self.max_new_tokens, bool) or
        not isinstance(self.max_new_tokens, (int, np.integer)) or self.max_new_tokens < 1):
      raise ValueError(
          f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
    if not self.temperature >= 0:
      raise ValueError(
          f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) \
        or self.top_k < 0:
      raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
    if self.eos_id is not None and (isinstance(self.eos_id, bool) or self.eos_id < 0):
      raise ValueError(f"eos_id must be a token id >= 0 or None, got {self.eos_id!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  @property
  def eos(self) -> int:
    return NO_EOS if self.eos_id is None else int(self.eos_id)


@struct.dataclass
class DecodeState:
  """Everything the decode loop carries (donated between prefill and decode).

  Attributes:
    cache: KVCache with P + T slots.
    tokens, logprobs, mask: the output buffers [B, T].
    done: bool [B], True once a row has emitted EOS (or reached its limit).
    last_token: int32 [B], the token to feed at the next step.
    limit: int32 [B], each row's length budget (at most T).
    step: int32 [], index of the next completion token to draw.
  """

  cache: KVCache
  tokens: jax.Array
  logprobs: jax.Array
  mask: jax.Array
  done: jax.Array
  last_token: jax.Array
  step: jax.Array
  limit: jax.Array

  def output(self) -> GenerationOutput:
    """The generation result held in this state."""
    return GenerationOutput(tokens=self.tokens, logprobs=self.logprobs, mask=self.mask,
                            num_steps=self.step)


def next_tokens(logits: jax.Array, rng: jax.Array, sample_ids: jax.Array,
                index: jax.Array | int, params: SamplingSettings
                ) -> tuple[jax.Array, jax.Array]:
  """Draws completion token `index` for each row.

  Args:
    logits: [B, vocab] raw logits at the last fed position.
    rng: the batch's base key.
    sample_ids: int [B] global sample ids (they, not batch rows, pick the keys).
    index: completion position being drawn.
    params: sampling settings.

  Returns:
    int32 tokens [B], drawn from the top-k / top-p sampling distribution, and their
    f32 log-probs [B] under the tempered, untruncated policy (see `sampling.py`).
  """
  return draw(logits, token_keys(rng, sample_ids, index), params.temperature,
              params.top_k, params.top_p)


def record_tokens(tokens_buf: jax.Array, logprobs_buf: jax.Array, mask_buf: jax.Array,
                  done: jax.Array, index: jax.Array | int, tokens: jax.Array,
                  logprobs: jax.Array, params: SamplingSettings,
                  limit: jax.Array | None = None):
  """Writes column `index` of the output buffers with EOS handling.

  Rows already done get `pad_id`, log-prob 0 and mask False; a row whose new token
  is EOS keeps it (mask True) and is done from then on, as is a row whose token
  `index` is the last its `limit` allows.

  Args:
    tokens_buf, logprobs_buf, mask_buf: [rows, T] output buffers.
    done: bool [rows] before this token.
    index: completion position of `tokens`.
    tokens, logprobs: [rows] the fresh draw.
    params: sampling settings.
    limit: optional int [rows], each row's length budget (tokens it may emit).

  Returns:
    (tokens_buf, logprobs_buf, mask_buf, done) updated.
  """
  emit = ~done
  tokens = jnp.where(emit, tokens, params.pad_id).astype(jnp.int32)
  logprobs = jnp.where(emit, logprobs, 0.0).astype(jnp.float32)
  column = lambda buf, value: jax.lax.dynamic_update_slice_in_dim(
      buf, value[:, None].astype(buf.dtype), index, axis=1)
  ends = tokens == params.eos
  if limit is not None:
    ends = ends | (index + 1 >= limit)
  return (column(tokens_buf, tokens), column(logprobs_buf, logprobs),
          column(mask_buf, emit), done | (emit & ends))


def completion_key_mask(prompt_mask: jax.Array, max_new_tokens: int) -> jax.Array:
  """bool [B, P + T]: real prompt slots plus every completion slot.

  Completion slots are all marked real; the model's slot-causal mask keeps each query
  from seeing slots not yet written, and rows past EOS are discarded anyway.
  """
  ones = jnp.ones((prompt_mask.shape[0], max_new_tokens), bool)
  return jnp.concatenate([prompt_mask.astype(bool), ones], axis=1)


def prefill_fn(graphdef: nnx.GraphDef, state: nnx.State, prompt_tokens: jax.Array,
               prompt_mask: jax.Array, rng: jax.Array, sample_ids: jax.Array,
               params: SamplingSettings, group_size: int = 1,
               limits: jax.Array | None = None) -> DecodeState:
  """Runs the whole prompt at cache slot 0 and draws completion token 0.

  Args:
    graphdef, state: `nnx.split` of an LM-head Transformer.
    prompt_tokens: int [B, P] left-padded.
    prompt_mask: bool [B, P].
    rng: base key of the batch.
    sample_ids: int [B].
    params: static sampling settings.
    group_size: n > 1 when rows [g * n, (g + 1) * n) hold the same prompt (a GRPO / RLOO
      group, `stages.generate.repeat_for_groups`): each prompt is then run once, and
      its cache and last logits are copied to its n rows, so the prefill costs B / n
      rows instead of B. Only the draws (per sample id) differ within a group.
    limits: optional int [B], each row's length budget (at most T; default T): a row
      stops after that many tokens as if it had emitted EOS. Benchmarks and tests force
      length distributions with it.

  Returns:
    The DecodeState after token 0 (step == 1).
  """
  model = nnx.merge(graphdef, state)
  batch, prompt_len = prompt_tokens.shape
  steps = params.max_new_tokens
  if batch % group_size:
    raise ValueError(f"prefill of {batch} rows in groups of {group_size}: the rows must "
                     "hold whole groups.")
  # [B / n, P]: one row per distinct prompt.
  tokens_once, mask_once = prompt_tokens[::group_size], prompt_mask[::group_size]
  cache = KVCache.zeros(model.config, batch // group_size, prompt_len + steps)
  logits, cache = model.forward_cached(
      tokens_once, default_positions(mask_once), completion_key_mask(mask_once, steps),
      cache, 0, last_only=True)
  # Left padding puts every row's last prompt token in the last column.
  logits = logits[:, -1]  # [B / n, vocab]
  if group_size > 1:
    copy = lambda x, axis: jnp.repeat(x, group_size, axis=axis)
    cache = KVCache(*(constrain(copy(c, 1), CACHE_AXES) for c in cache))
    logits = copy(logits, 0)  # [B, vocab]
  tokens, logprobs = next_tokens(logits, rng, sample_ids, 0, params)
  limit = (jnp.full((batch,), steps, jnp.int32) if limits is None
           else jnp.minimum(jnp.asarray(limits, jnp.int32), steps))
  buffers = (jnp.full((batch, steps), params.pad_id, jnp.int32),
             jnp.zeros((batch, steps), jnp.float32), jnp.zeros((batch, steps), bool))
  buffers = tuple(constrain(b, ("batch", "length")) for b in buffers)
  tok_buf, lp_buf, mask_buf, done = record_tokens(
      *buffers, jnp.zeros((batch,), bool), 0, tokens, logprobs, params, limit)
  return DecodeState(cache=cache, tokens=tok_buf, logprobs=lp_buf, mask=mask_buf,
                     done=done, last_token=tokens, step=jnp.ones((), jnp.int32),
                     limit=limit)


def decode_fn(graphdef: nnx.GraphDef, state: nnx.State, decode_state: DecodeState,
              prompt_mask: jax.Array, rng: jax.Array, sample_ids: jax.Array,
              params: SamplingSettings) -> DecodeState:
  """Decodes tokens 1..T-1 one slot per step, stopping once every row is done.

  Args:
    graphdef, state: `nnx.split` of the model.
    decode_state: from `prefill_fn` (donate it when jitting).
    prompt_mask: bool [B, P] (for key mask and positions).
    rng, sample_ids: as given to `prefill_fn`.
    params: static sampling settings.

  Returns:
    The final DecodeState (`.output()` is the GenerationOutput). Returning the whole
    state, cache included, lets every donated input buffer alias an output, so the
    decode runs without copying the cache; callers simply drop what they don't need.
  """
  model = nnx.merge(graphdef, state)
  prompt_len = prompt_mask.shape[1]
  steps = params.max_new_tokens
  key_mask = completion_key_mask(prompt_mask, steps)
  num_real = jnp.sum(prompt_mask.astype(jnp.int32), axis=1)  # [B]
  # Each layer's weights as arrays of their own, copied once per call rather than sliced
  # out of the stacked arrays at every token (`Layers.per_layer`). Not under fsdp: there
  # the loop gathers one layer's shards at a time, and copies taken outside it would be
  # gathered all at once (every layer's full weights on every device).
  active = current_axis_rules()
  fsdp = active[0].shape.get("fsdp", 1) if active is not None else 1
  layer_params = model.layers.per_layer() if fsdp == 1 else None
  if layer_params is not None:
    # Each layer's cache as an array of its own for the loop (`KVCache.unstack`).
    decode_state = decode_state.replace(cache=decode_state.cache.unstack())

  def cond(s: DecodeState):
    return (s.step < steps) & ~jnp.all(s.done)

  def body(s: DecodeState):
    # The token drawn at step-1 is fed at its own slot and position.
    fed = s.step - 1
    positions = (num_real + fed)[:, None]  # [B, 1]
    logits, cache = model.forward_cached(s.last_token[:, None], positions, key_mask,
                                         s.cache, prompt_len + fed, layer_params)
    tokens, logprobs = next_tokens(logits[:, 0], rng, sample_ids, s.step, params)
    tok_buf, lp_buf, mask_buf, done = record_tokens(
        s.tokens, s.logprobs, s.mask, s.done, s.step, tokens, logprobs, params, s.limit)
    return DecodeState(cache=cache, tokens=tok_buf, logprobs=lp_buf, mask=mask_buf,
                       done=done, last_token=tokens, step=s.step + 1, limit=s.limit)

  final = jax.lax.while_loop(cond, body, decode_state)
  return final.replace(cache=final.cache.stack())


def make_generate_fns(graphdef: nnx.GraphDef, params: SamplingSettings, *,
                      group_size: int = 1,
                      prefill_shardings: dict[str, Any] | None = None,
                      decode_shardings: dict[str, Any] | None = None,
                      ) -> tuple[Callable, Callable]:
  """Jits the prefill and decode building blocks for one model structure.

  Args:
    graphdef: the model's graph definition (static).
    params: static sampling settings.
    group_size: rows per distinct prompt, each prompt prefilled once (`prefill_fn`).
    prefill_shardings: optional `jax.jit` kwargs (`in_shardings`, `out_shardings`)
      for `prefill(state, prompt_tokens, prompt_mask, rng, sample_ids, limits=None)`.
    decode_shardings: likewise for
      `decode(state, decode_state, prompt_mask, rng, sample_ids)`.

  Returns:
    (prefill, decode): `prefill` returns a DecodeState, `decode` donates it and
    returns the final DecodeState (call `.output()` on it). Trace them inside
    `parallel.logical.axis_rules(mesh, rules)` for activation constraints to apply.
  """
  def prefill(state, prompt_tokens, prompt_mask, rng, sample_ids, limits=None):
    return prefill_fn(graphdef, state, prompt_tokens, prompt_mask, rng, sample_ids,
                      params, group_size, limits)

  def decode(state, decode_state, prompt_mask, rng, sample_ids):
    return decode_fn(graphdef, state, decode_state, prompt_mask, rng, sample_ids,
                     params)

  return (jax.jit(prefill, **(prefill_shardings or {})),
          jax.jit(decode, donate_argnums=1, **(decode_shardings or {})))


_FNS_CACHE: dict[Any, tuple[Callable, Callable]] = {}


def cached_generate_fns(graphdef: nnx.GraphDef, params: SamplingSettings
                        ) -> tuple[Callable, Callable]:
  """`make_generate_fns` memoised on (graphdef, params, active axis rules).

  The active `axis_rules` context is part of the key because `constrain` reads it at
  trace time, which `jax.jit`'s own cache does not see.
  """
  key = (graphdef, params, current_axis_rules())
  if key not in _FNS_CACHE:
    _FNS_CACHE[key] = make_generate_fns(graphdef, params)
  return _FNS_CACHE[key]


def check_prompts(prompt_tokens, prompt_mask, sample_ids=None):
  """Validates prompt arrays and returns (tokens int32, mask bool, sample_ids int32).

  Raises:
    ValueError: shapes disagree, or (when concrete) a row is not left-padded or has no
      real token.
  """
  prompt_tokens = jnp.asarray(prompt_tokens)
  prompt_mask = jnp.asarray(prompt_mask)
  if prompt_tokens.ndim != 2:
    raise ValueError(
        f"prompt_tokens must be [batch, prompt_len], got shape {prompt_tokens.shape}")
  if prompt_mask.shape != prompt_tokens.shape:
    raise ValueError(
        f"prompt_mask shape {prompt_mask.shape} must equal prompt_tokens shape "
        f"{prompt_tokens.shape}")
  batch = prompt_tokens.shape[0]
  if sample_ids is None:
    sample_ids = jnp.arange(batch, dtype=jnp.int32)
  sample_ids = jnp.asarray(sample_ids, jnp.int32)
  if sample_ids.shape != (batch,):
    raise ValueError(f"sample_ids must have shape ({batch},), got {sample_ids.shape}")
  prompt_mask = prompt_mask.astype(bool)
  try:
    mask = np.asarray(prompt_mask)
  except jax.errors.TracerArrayConversionError:
    mask = None  # traced: the caller's jit owns validation
  if mask is not None:
    if not mask[:, -1].all():
      rows = np.nonzero(~mask[:, -1])[0].tolist()
      raise ValueError(
          f"prompt rows {rows[:8]} do not end in a real token; prompts must be "
          "LEFT-padded (padding first, last column real) and non-empty")
    if mask.size and (np.diff(mask.astype(np.int8), axis=1) < 0).any():
      raise ValueError("prompt_mask has a real token before a pad in some row; "
                       "prompts must be left-padded")
  return prompt_tokens.astype(jnp.int32), prompt_mask, sample_ids


def generate(model: nnx.Module, prompt_tokens: jax.Array, prompt_mask: jax.Array,
             max_new_tokens: int, *, rng: jax.Array, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, eos_id: int | None,
             pad_id: int = 0, sample_ids: jax.Array | None = None,
             limits: jax.Array | None = None) -> GenerationOutput:
  """Samples completions for a left-padded batch of prompts with a KV cache.

  Args:
    model: an LM-head Transformer (its params may be sharded; call inside
      `axis_rules(mesh, rules)` to constrain activations on that mesh).
    prompt_tokens: int [B, P], left-padded.
    prompt_mask: bool [B, P], True on real tokens.
    max_new_tokens: T.
    rng: base key; sample i's token t uses `token_keys(rng, sample_ids, t)[i]`.
    temperature, top_k, top_p: the sampling distribution (temperature 0 = greedy).
    eos_id: end-of-sequence token, or None to never stop early.
    pad_id: written after EOS.
    sample_ids: int [B] global ids (default arange(B)); tokens depend on the id, not
      on the row a sample occupies.
    limits: optional int [B] per-row length budgets (`prefill_fn`).

  Returns:
    GenerationOutput with [B, T] tokens / logprobs / mask and the steps decoded.
  """
  if getattr(model, "config", None) is None or model.config.head != "lm":
    raise ValueError("generate needs a Transformer with head='lm' (model.config.head)")
  params = SamplingSettings(max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                          top_k=int(top_k), top_p=float(top_p), eos_id=eos_id,
                          pad_id=int(pad_id))
  prompt_tokens, prompt_mask, sample_ids = check_prompts(prompt_tokens, prompt_mask,
                                                         sample_ids)
  graphdef, state = nnx.split(model)
  prefill, decode = cached_generate_fns(graphdef, params)
  decode_state = prefill(state, prompt_tokens, prompt_mask, rng, sample_ids, limits)
  return decode(state, decode_state, prompt_mask, rng, sample_ids).output()


def generate_repeated(model: nnx.Module, prompt_tokens: np.ndarray, prompt_mask: np.ndarray,
                      k: int, sampling: SamplingSettings, *, rng: jax.Array
                      ) -> tuple[np.ndarray, np.ndarray, GenerationOutput]:
  """k completions of every prompt from `sampling`'s distribution, the k of a prompt in
  consecutive rows; returns the repeated prompts ([B * k, P] tokens and mask) and the
  output. Sample ids are the rows' positions, so the draws depend on the prompts' order
  and `rng`, not on the layout the model runs on."""
  prompt_tokens = np.repeat(np.asarray(prompt_tokens), k, axis=0)  # [B * k, P]
  prompt_mask = np.repeat(np.asarray(prompt_mask), k, axis=0)
  s = sampling
  out = generate(model, prompt_tokens, prompt_mask, s.max_new_tokens, rng=rng,
                 temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, eos_id=s.eos_id,
                 pad_id=s.pad_id)
  return prompt_tokens, prompt_mask, out
