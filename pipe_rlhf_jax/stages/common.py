"""What every stage shares: its mesh and rules, parameter layouts, and sequence scoring.

A `StageLayout` is a stage's parallel strategy made concrete: a mesh on its own devices
plus the logical-axis rules. It turns a model's logical axes into shardings and moves
pytrees onto the stage through the one reshard helper, so every cross-mesh move is timed.

`completion_logprobs` (and its SFT loss, `completion_nll`) / `completion_values` /
`sequence_scores` read a model over the
shared `[prompt | completion]` layout (see `ppo/types.py`); the SFT, reward-model and
PPO phases and all three stages use them, so every log-prob in the system is computed
one way: under the tempered, untruncated policy (top-k / top-p never enter).

The `packed_*` variants compute the same outputs over packed rows of real tokens only
(`stages/packing.py`), for the inference and training stages' `pack_tokens` settings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np

from pipe_rlhf_jax.distributed.arrays import put_global
from pipe_rlhf_jax.generation.sampling import policy_logprobs, token_logprob
from pipe_rlhf_jax.parallel import logical
from pipe_rlhf_jax.parallel.mesh import describe
from pipe_rlhf_jax.parallel.reshard import TransferStats, reshard
from pipe_rlhf_jax.ppo.advantages import masked_mean
from pipe_rlhf_jax.ppo.losses import entropy_from_logprobs


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


class MeshMismatch(ValueError):
  """A model's parameters do not divide over a stage's mesh (heads over tensor, layers
  over pipeline, ...); the message names the config field and the sizes that would."""


@dataclasses.dataclass
class StageLayout:
  """A stage's mesh and logical rules.

  Attributes:
    name: "generate", "infer", "train" (or "sft", "reward_model").
    mesh: the stage's Mesh, on its own subset of devices.
    rules: logical -> mesh axis rules used for parameters and activations.
  """

  name: str
  mesh: jax.sharding.Mesh
  rules: logical.Rules

  def __str__(self) -> str:
    return f"{self.name}: {describe(self.mesh)}"

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  def batch_sharding(self, ndim: int) -> NamedSharding:
    """Sharding of a [batch, ...] array: batch over the data-like axes, rest replicated."""
    spec = logical.logical_to_spec(("batch",) + (None,) * (ndim - 1), self.rules, self.mesh)
    return NamedSharding(self.mesh, spec)

  def batch_ways(self) -> int:
    """How many shards a [batch, ...] array is split into on this stage."""
    spec = self.batch_sharding(1).spec[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
    return int(np.prod([self.mesh.shape[a] for a in axes], dtype=np.int64))

  def batch_shardings(self, tree: Any) -> Any:
    """Batch shardings for every array leaf of `tree` (scalars replicated)."""
    return jax.tree.map(
        lambda x: self.batch_sharding(np.ndim(x)) if np.ndim(x) else self.replicated, tree)

  def param_shardings(self, state: nnx.State) -> nnx.State:
    """NamedShardings with the same pytree structure as a model's parameter State."""
    return jax.tree.map(
        lambda v: v.replace(logical.logical_sharding(self.mesh, v.get_metadata()["axes"],
                                                     self.rules)),
        state, is_leaf=_is_variable)

  def check_params(self, state: nnx.State, field: str) -> None:
    """Raises `MeshMismatch`, naming `field`, when a parameter cannot be split over this
    mesh."""
    axes = jax.tree.map(lambda v: v.get_metadata()["axes"], state, is_leaf=_is_variable)
    try:
      logical.check_divisible(state, axes, self.mesh, self.rules)
    except ValueError as e:
      raise MeshMismatch(f"{field}: the model does not fit this stage's mesh "
                         f"({describe(self.mesh)}): {e}") from None

  def put_params(self, state: nnx.State) -> tuple[nnx.State, TransferStats]:
    """Moves parameters onto this stage's mesh in its layout."""
    return reshard(state, self.param_shardings(state))

  def put_batch(self, tree: Any) -> Any:
    """Places a host batch (numpy dict / dataclass) on this stage, split over batch.

    On a mesh spanning several processes each process uploads only its own rows of the
    (identical) global batch.
    """
    return put_global(tree, self.batch_shardings(tree))

  def rules_context(self):
    """Context activating this stage's activation constraints while tracing."""
    return logical.axis_rules(self.mesh, self.rules)


def policy_only(rollout, x: jax.Array | None) -> jax.Array | None:
  """`x` [batch, completion_len] with 0 wherever the policy sampled nothing (an
  episode's environment tokens; padding is 0 already): those positions take no part in
  any target, and a 0 there keeps every ratio and difference of them finite."""
  if x is None or rollout.policy_mask is None:
    return x
  return jnp.where(rollout.loss_mask, x, 0.0)


def completion_hidden(model, prompt_tokens: jax.Array, prompt_mask: jax.Array,
                      completion_tokens: jax.Array, completion_mask: jax.Array) -> jax.Array:
  """The residual stream [batch, completion_len, embed] at the positions that predict /
  evaluate each completion token: entry t is position P - 1 + t, with the prompt and the
  completion tokens < t in context. Sliced before any head is applied, so the head (and
  an LM head's vocabulary) touches only these positions."""
  tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)
  mask = jnp.concatenate([prompt_mask, completion_mask], axis=1).astype(bool)
  prompt_len, completion_len = prompt_tokens.shape[1], completion_tokens.shape[1]
  return model.hidden(tokens, mask)[:, prompt_len - 1:prompt_len - 1 + completion_len]


def completion_logprobs(graphdef, params, prompt_tokens, prompt_mask, completion_tokens,
                        completion_mask, *, temperature=1.0, return_entropy=False):
  """Log-probs [batch, completion_len] of the completion under the policy distribution.

  The policy is the tempered, untruncated softmax(logits / temperature): top-k / top-p
  only filter what the sampler draws and never enter a log-prob (the convention of
  verl, OpenRLHF and TRL; see `generation/sampling.py`). So every sampled token has a
  finite log-prob under every model (actor, reference), and on equal weights these
  equal the behaviour log-probs the sampler recorded: the first PPO ratio is 1.

  Memory: the LM head and the log-softmax run on `model.config.logits_chunk_size`
  completion positions at a time (0: all), inside a rematerialised scan, so neither the
  forward nor the backward pass holds `[batch, completion_len, vocab]` f32 logits.

  Args:
    graphdef, params: an LM-head model.
    prompt_tokens, prompt_mask: [batch, prompt_len], left-padded.
    completion_tokens, completion_mask: [batch, completion_len], right-padded.
    temperature: the sampling temperature (0 = greedy: the untempered distribution).
    return_entropy: also return the per-token entropy of the same distribution.

  Returns:
    f32 [batch, completion_len] log-probs, 0 on padding; with `return_entropy`, a
    (log-probs, entropy) pair, the entropy [batch, completion_len] in nats, 0 on padding.
  """
  model = nnx.merge(graphdef, params)
  h = completion_hidden(model, prompt_tokens, prompt_mask, completion_tokens,
                        completion_mask)  # [batch, completion_len, embed]
  logprobs, entropy = _head_logprobs(model, h, completion_tokens, temperature,
                                     return_entropy)
  logprobs = jnp.where(completion_mask, logprobs, 0.0)
  if not return_entropy:
    return logprobs
  return logprobs, jnp.where(completion_mask, entropy, 0.0)


def _head_logprobs(model, h: jax.Array, targets: jax.Array, temperature: float,
                   return_entropy: bool = False):
  """Log-probs of `targets` [rows, positions] from the hidden states `h` [rows,
  positions, embed] under the tempered policy, the head run `logits_chunk_size`
  positions at a time; with `return_entropy` also each position's entropy (else None)."""

  def one_chunk(_, xs):
    h_chunk, tokens_chunk = xs
    logprobs_all = policy_logprobs(model.head(h_chunk), temperature)  # [r, chunk, vocab]
    logprobs = token_logprob(logprobs_all, tokens_chunk)
    entropy = entropy_from_logprobs(logprobs_all) if return_entropy else None
    return None, (logprobs, entropy)

  return _over_position_chunks(one_chunk, h, targets, model.config.logits_chunk_size)


def completion_nll(graphdef, params, prompt_tokens, prompt_mask, completion_tokens,
                   completion_mask) -> jax.Array:
  """The SFT loss: token-mean negative log-likelihood (f32 scalar) of the completions.

  At temperature 1 over every unmasked completion token (EOS included), pooled over the
  batch; the SFT phase's objective and PPO-ptx's term are this one function.
  """
  logprobs = completion_logprobs(graphdef, params, prompt_tokens, prompt_mask,
                                 completion_tokens, completion_mask, temperature=1.0)
  return -masked_mean(logprobs, completion_mask)


def _over_position_chunks(fn, h: jax.Array, tokens: jax.Array, chunk_size: int):
  """Applies `fn(None, (h_chunk, tokens_chunk)) -> (None, outputs)` over chunks of
  positions and returns the outputs [batch, length] reassembled. One chunk runs inline;
  several run in a scan whose body is rematerialised (one chunk's logits alive at a
  time, in the backward pass too)."""
  batch, length, embed = h.shape
  chunk = min(chunk_size or length, length)
  if chunk == length:
    return fn(None, (h, tokens))[1]
  num_chunks = -(-length // chunk)
  pad = num_chunks * chunk - length
  h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
  tokens = jnp.pad(tokens, ((0, 0), (0, pad)))
  # [chunks, batch, chunk, ...]
  xs = (h.reshape(batch, num_chunks, chunk, embed).swapaxes(0, 1),
        tokens.reshape(batch, num_chunks, chunk).swapaxes(0, 1))
  _, outs = jax.lax.scan(jax.checkpoint(fn, prevent_cse=False), None, xs)
  unchunk = lambda x: x.swapaxes(0, 1).reshape(batch, num_chunks * chunk)[:, :length]
  return jax.tree.map(unchunk, outs)


def completion_values(graphdef, params, prompt_tokens, prompt_mask, completion_tokens,
                      completion_mask) -> jax.Array:
  """Critic values [batch, completion_len]: V(state before completion token t)."""
  model = nnx.merge(graphdef, params)
  values = model.head(completion_hidden(model, prompt_tokens, prompt_mask,
                                        completion_tokens, completion_mask))
  return jnp.where(completion_mask, values, 0.0)


def sequence_scores(graphdef, params, prompt_tokens, prompt_mask, completion_tokens,
                    completion_mask) -> jax.Array:
  """Reward-model scores [batch], read at the last real token of each sequence."""
  model = nnx.merge(graphdef, params)
  tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)
  mask = jnp.concatenate([prompt_mask, completion_mask], axis=1).astype(bool)
  h = model.hidden(tokens, mask)  # [batch, length, embed]
  last = prompt_tokens.shape[1] - 1 + jnp.sum(completion_mask.astype(jnp.int32), axis=1)
  h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)  # [batch, 1, embed]
  return model.head(h_last)[:, 0]


def packed_hidden(model, plan, prompt_tokens: jax.Array,
                  completion_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The residual stream over packed rows (`stages/packing.py`), and their tokens.

  Args:
    model: a merged model.
    plan: a `PackPlan` on the device ([rows, budget] fields, [batch, ...] gathers).
    prompt_tokens: [batch, P]; completion_tokens: [batch, T]: the padded layout the plan
      was made for. Gathered into the rows here, on the device.

  Returns:
    (h [rows, budget, embed], tokens int [rows, budget]).
  """
  flat = jnp.concatenate([prompt_tokens, completion_tokens], axis=1).reshape(-1)
  tokens = jnp.take(flat, plan.source, axis=0)  # [rows, budget]
  h = model.hidden(tokens, positions=plan.positions, segment_ids=plan.segment_ids)
  return h, tokens


def packed_completion_logprobs(graphdef, params, plan, prompt_tokens, completion_tokens,
                               completion_mask, *, temperature=1.0, return_entropy=False):
  """`completion_logprobs` computed over packed rows: the same [batch, T] f32 log-probs
  (0 on padding), and with `return_entropy` the same entropies. The LM head, the
  costliest part at a large vocabulary, runs on the K states that predict real completion
  tokens only (`PackPlan.head_index`): not on the prompts' columns, the rows' spare
  columns, or the padded layout's completion padding. Differentiable: the training
  stage's packed gradient steps take their log-probs here (the gathers' gradients
  scatter back into the rows)."""
  model = nnx.merge(graphdef, params)
  h, _ = packed_hidden(model, plan, prompt_tokens, completion_tokens)
  rows, budget, embed = h.shape
  h = h.reshape(rows * budget, embed)[plan.head_index]  # [K, embed]
  targets = completion_tokens.reshape(-1)[plan.head_targets]  # [K]
  logprobs, entropy = _head_logprobs(model, h[None], targets[None], temperature,
                                     return_entropy)  # [1, K] each
  read = lambda x: jnp.where(completion_mask, x[0][plan.completion_slot], 0.0)  # [batch, T]
  if not return_entropy:
    return read(logprobs)
  return read(logprobs), read(entropy)


def packed_completion_values(graphdef, params, plan, prompt_tokens, completion_tokens,
                             completion_mask) -> jax.Array:
  """`completion_values` computed over packed rows: critic values [batch, T]."""
  model = nnx.merge(graphdef, params)
  h, _ = packed_hidden(model, plan, prompt_tokens, completion_tokens)
  values = model.head(h)[plan.completion_rows, plan.completion_cols]  # [batch, T]
  return jnp.where(completion_mask, values, 0.0)


def packed_sequence_scores(graphdef, params, plan, prompt_tokens,
                           completion_tokens) -> jax.Array:
  """`sequence_scores` computed over packed rows: scores [batch] at each last token."""
  model = nnx.merge(graphdef, params)
  h, _ = packed_hidden(model, plan, prompt_tokens, completion_tokens)
  h_last = h[plan.last_rows, plan.last_cols][:, None]  # [batch, 1, embed]
  return model.head(h_last)[:, 0]
