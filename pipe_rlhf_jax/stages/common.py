"""What every stage shares: its mesh and rules, parameter layouts, and sequence scoring.

A `StageLayout` is a stage's parallel strategy made concrete: a mesh on its own devices
plus the logical-axis rules. It turns a model's logical axes into shardings and moves
pytrees onto the stage through the one reshard helper, so every cross-mesh move is timed.

`completion_logprobs` / `completion_values` / `sequence_scores` read a model over the
shared `[prompt | completion]` layout (see `ppo/types.py`); the SFT, reward-model and
PPO phases and all three stages use them, so every log-prob in the system is computed
one way: under the tempered, untruncated policy (top-k / top-p never enter).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from pipe_rlhf_jax.generation.sampling import policy_logprobs, token_logprob
from pipe_rlhf_jax.parallel import logical
from pipe_rlhf_jax.parallel.mesh import describe
from pipe_rlhf_jax.parallel.reshard import TransferStats, reshard
from pipe_rlhf_jax.ppo.losses import entropy_from_logits


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


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
    """Raises a readable error when a parameter cannot be split over this mesh."""
    axes = jax.tree.map(lambda v: v.get_metadata()["axes"], state, is_leaf=_is_variable)
    try:
      logical.check_divisible(state, axes, self.mesh, self.rules)
    except ValueError as e:
      raise ValueError(f"{field}: the model does not fit this stage's mesh "
                       f"({describe(self.mesh)}): {e}") from None

  def put_params(self, state: nnx.State) -> tuple[nnx.State, TransferStats]:
    """Moves parameters onto this stage's mesh in its layout."""
    return reshard(state, self.param_shardings(state))

  def put_batch(self, tree: Any) -> Any:
    """Places a host batch (numpy dict / dataclass) on this stage, split over batch."""
    return jax.device_put(tree, self.batch_shardings(tree))

  def rules_context(self):
    """Context activating this stage's activation constraints while tracing."""
    return logical.axis_rules(self.mesh, self.rules)


def completion_logits(graphdef: nnx.GraphDef, params: nnx.State, prompt_tokens: jax.Array,
                      prompt_mask: jax.Array, completion_tokens: jax.Array,
                      completion_mask: jax.Array) -> jax.Array:
  """Head outputs at the positions that predict / evaluate each completion token.

  Returns:
    [batch, completion_len, ...]: entry t is the head output at sequence position
    P - 1 + t, i.e. with the prompt and completion tokens < t in context.
  """
  model = nnx.merge(graphdef, params)
  tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)
  mask = jnp.concatenate([prompt_mask, completion_mask], axis=1).astype(bool)
  out = model(tokens, mask)
  prompt_len, completion_len = prompt_tokens.shape[1], completion_tokens.shape[1]
  return out[:, prompt_len - 1:prompt_len - 1 + completion_len]


def completion_logprobs(graphdef, params, prompt_tokens, prompt_mask, completion_tokens,
                        completion_mask, *, temperature=1.0, return_entropy=False):
  """Log-probs [batch, completion_len] of the completion under the policy distribution.

  The policy is the tempered, untruncated softmax(logits / temperature): top-k / top-p
  only filter what the sampler draws and never enter a log-prob (the convention of
  verl, OpenRLHF and TRL; see `generation/sampling.py`). So every sampled token has a
  finite log-prob under every model (actor, reference), and on equal weights these
  equal the behaviour log-probs the sampler recorded: the first PPO ratio is 1.

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
  logits = completion_logits(graphdef, params, prompt_tokens, prompt_mask,
                             completion_tokens, completion_mask)
  logprobs_all = policy_logprobs(logits, temperature)  # [batch, completion_len, vocab]
  logprobs = token_logprob(logprobs_all, completion_tokens)
  logprobs = jnp.where(completion_mask, logprobs, 0.0)
  if not return_entropy:
    return logprobs
  # Log-probs are logits of the same distribution, so no second temperature rule here.
  entropy = entropy_from_logits(logprobs_all)  # [batch, completion_len]
  return logprobs, jnp.where(completion_mask, entropy, 0.0)


def completion_values(graphdef, params, prompt_tokens, prompt_mask, completion_tokens,
                      completion_mask) -> jax.Array:
  """Critic values [batch, completion_len]: V(state before completion token t)."""
  values = completion_logits(graphdef, params, prompt_tokens, prompt_mask,
                             completion_tokens, completion_mask)
  return jnp.where(completion_mask, values, 0.0)


def sequence_scores(graphdef, params, prompt_tokens, prompt_mask, completion_tokens,
                    completion_mask) -> jax.Array:
  """Reward-model scores [batch], read at the last real token of each sequence."""
  model = nnx.merge(graphdef, params)
  tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)
  mask = jnp.concatenate([prompt_mask, completion_mask], axis=1).astype(bool)
  per_token = model(tokens, mask)  # [batch, length]
  last = prompt_tokens.shape[1] - 1 + jnp.sum(completion_mask.astype(jnp.int32), axis=1)
  return jnp.take_along_axis(per_token, last[:, None], axis=1)[:, 0]
