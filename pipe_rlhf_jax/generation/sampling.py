"""The sampling distribution, the policy distribution, and the randomness of a draw.

The convention (the one verl, OpenRLHF and TRL use): the policy pi_theta that PPO
optimises is the *tempered, untruncated* softmax(logits / T). Top-k and top-p are a
filter on the behaviour side only: they shape which tokens get drawn, never the
probability PPO assigns to them. So every log-prob the system records or computes --
behaviour log-probs at generation, the trainer's log-probs and ratios, reference
log-probs, KL and entropy -- is under `policy_logprobs`. On equal weights the PPO ratio
is exactly 1, and every sampled token has a finite log-prob under every model (a token
outside the reference's own nucleus would otherwise get NEG_INF and a KL of ~1e30).

This module owns what must agree bit for bit wherever it is used:
- `policy_logprobs`: the policy distribution (temperature only).
- `sampling_logprobs`: the distribution tokens are drawn from (temperature, top-k,
  top-p); used for drawing and nothing else.
- `draw`: one draw from the sampling distribution, returned with its log-prob under
  the policy distribution; both decoders (plain and pipelined) go through it.
- `token_keys`: the random key of (sample, position). Keys depend only on the sample's
  global id and the token index, never on batch or micro-batch placement, so the plain
  and the pipelined decoders draw identical tokens.
- `sample`: the draw itself (Gumbel-max over the processed log-probs; argmax when greedy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so that excluded tokens never turn sums into NaN


def policy_logprobs(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
  """Log-probabilities of the policy distribution softmax(logits / temperature).

  Args:
    logits: [..., vocab] raw model logits.
    temperature: > 0 divides the logits; 0 (greedy decoding) reports the untempered
      distribution, as there is no tempered one to report.

  Returns:
    [..., vocab] f32 log-probs, finite for every token (no top-k / top-p here: see the
    module docstring).
  """
  logits = logits.astype(jnp.float32)
  if temperature > 0:
    logits = logits / temperature
  return jax.nn.log_softmax(logits, axis=-1)


def sampling_logprobs(logits: jax.Array, temperature: float = 1.0, top_k: int = 0,
                      top_p: float = 1.0) -> jax.Array:
  """Log-probabilities of the distribution that tokens are sampled from.

  Only for drawing: the log-prob PPO records for a drawn token is `policy_logprobs`.

  Args:
    logits: [..., vocab] raw model logits.
    temperature: > 0 divides the logits; 0 means greedy decoding, for which the
      untempered distribution is reported (the argmax token is what gets chosen).
    top_k: keep the k most likely tokens (0 = all).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1 = all).

  Returns:
    [..., vocab] f32 log-probs; tokens outside the top-k / top-p set get NEG_INF.
  """
  logits = logits.astype(jnp.float32)
  if temperature > 0:
    logits = logits / temperature
  if top_k and top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, NEG_INF, logits)
  if top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep a token if the mass strictly before it is below top_p (the top token always).
    before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = before < top_p
    keep = jnp.zeros_like(keep_sorted).at[
        tuple(jnp.indices(order.shape)[:-1]) + (order,)].set(keep_sorted)
    logits = jnp.where(keep, logits, NEG_INF)
  return jax.nn.log_softmax(logits, axis=-1)


def token_keys(rng: jax.Array, sample_ids: jax.Array, position: jax.Array | int
               ) -> jax.Array:
  """Keys [batch] for drawing token `position` of each sample in `sample_ids` [batch].

  `position` is one index for every row, or an int [batch] (the continuous-batching
  engine, whose rows are at different positions): a token's key depends only on its
  sample id and position, never on the row or step that draws it.
  """
  fold = lambda sid, pos: jax.random.fold_in(jax.random.fold_in(rng, sid), pos)
  return jax.vmap(fold)(sample_ids, jnp.broadcast_to(position, jnp.shape(sample_ids)))


def first_argmax(x: jax.Array) -> jax.Array:
  """int32 [...]: the index of the first maximum of x [..., n] along its last axis.

  Equal to `jnp.argmax` (a NaN counts as the maximum, the first one wins), computed as
  two plain reductions (the maximum, then the first index holding it) instead of
  argmax's reduction over (value, index) pairs, which XLA's CPU backend runs several
  times slower over a large vocabulary: a decode step at SmolLM2-135M's shape with 4 of
  its layers, batch 8, takes 11.6-12.0 ms with `jnp.argmax` and 9.6-10.1 ms with this
  (`python -m experiments.bench_generate --shape smollm2-135m --layers 4 --batch-sizes 8
  --prompt-len 64 --new-tokens 64 --repeats 5`, two alternating runs).
  """
  top = jnp.max(x, axis=-1, keepdims=True)
  index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  hit = (x == top) | jnp.isnan(x)
  return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1).astype(jnp.int32)


def sample(logprobs: jax.Array, keys: jax.Array, greedy: bool) -> jax.Array:
  """Draws one token per row: logprobs [batch, vocab], keys [batch] -> int32 [batch]."""
  if greedy:
    return first_argmax(logprobs)
  gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logprobs.shape[-1:], jnp.float32))(keys)
  return first_argmax(logprobs + gumbel)


def token_logprob(logprobs: jax.Array, tokens: jax.Array) -> jax.Array:
  """Gathers logprobs [..., vocab] at tokens [...] -> [...]."""
  return jnp.take_along_axis(logprobs, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def draw(logits: jax.Array, keys: jax.Array, temperature: float, top_k: int,
         top_p: float) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row from the truncated distribution, scored by the policy.

  Args:
    logits: [batch, vocab] raw logits.
    keys: [batch] per-row keys (see `token_keys`).
    temperature, top_k, top_p: the sampling settings (temperature 0 = greedy).

  Returns:
    (tokens int32 [batch], logprobs f32 [batch]): the drawn tokens and their
    log-probs under `policy_logprobs(logits, temperature)`, which is what the trainer
    and the reference recompute on a full forward pass.
  """
  tokens = sample(sampling_logprobs(logits, temperature, top_k, top_p), keys,
                  greedy=temperature == 0)
  return tokens, token_logprob(policy_logprobs(logits, temperature), tokens)
