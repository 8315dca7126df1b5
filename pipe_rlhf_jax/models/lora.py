"""LoRA adapters on the transformer's projections: their parameters, and the trained /
frozen split of a model's state.

A projection `W` ([*in, *out], e.g. q_proj's [embed, heads, head_dim]) with an adapter
computes `x @ W + (alpha / rank) * (x @ A) @ B`, where `A` is [*in, rank] and `B` is
[rank, *out] (Hu et al., 2021). `B` starts at zero, so a model with fresh adapters
computes exactly what its base does; `A` starts uniform in +-1/sqrt(fan_in), the
initialisation peft gives `lora_A` (Kaiming-uniform with a = sqrt(5)).

This module owns:
- `Adapter`, the variable type of adapter weights (an `nnx.Param`, so every reader of a
  model's parameters sees them; the type is what separates them from the base);
- the adapter weights' shapes and logical axes (`adapter_axes`): they follow their
  projection's axes, with an unsharded rank axis, so a mesh that shards a projection
  shards its adapter the same way (the `layers` axis too: a pipeline stage holds its
  layers' adapters);
- the split of a model's state into what the trainer updates and what stays frozen
  (`split_trainable`, `merge`): with adapters, the adapters (and a critic's fresh value
  head); without, everything;
- the base model of an adapted one (`base_of`: the reference policy, no second copy of
  the weights' structure), the merged weights (`merged`: for the Hugging Face export),
  and adapters added to a base (`with_adapters`).

Why written here rather than taken from a library: the model keeps each projection as
one stacked raw array (`[layers, *in, *out]`, applied in a layer scan and sharded by
logical axes), not as `nnx.Linear` modules, which is what flax's `nnx.LoRA` and qwix's
LoRA provider wrap; an adapter here is two more stacked arrays beside the projection,
which keeps the layer scan, the pipeline's layer slices and the shardings as they are.
The export is peft's own layout (`models.hf.save_adapters`), which peft loads.
"""

from __future__ import annotations

import math

from flax import nnx
import jax
import jax.numpy as jnp

# The projections an adapter may sit on, and how many leading dimensions of each
# projection's weight are its input (o_proj's [heads, head_dim] -> embed takes two).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NUM_IN = {"o_proj": 2}
# Shorthands of `lora.targets` (a config's comma-separated list).
GROUPS = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
          "mlp": ("gate_proj", "up_proj", "down_proj"),
          "all": TARGETS}


class Adapter(nnx.Param):
  """An adapter weight (`A` or `B` of a LoRA pair): trained where the base is frozen."""


def parse_targets(text: str | tuple[str, ...], field: str = "lora.targets"
                  ) -> tuple[str, ...]:
  """`"attention,mlp"` / `"q_proj,v_proj"` / a tuple -> the projections, in model order."""
  names = [t.strip() for t in (text.split(",") if isinstance(text, str) else text)]
  chosen = set()
  for name in names:
    if not name:
      continue
    if name in GROUPS:
      chosen.update(GROUPS[name])
    elif name in TARGETS:
      chosen.add(name)
    else:
      raise ValueError(f"{field}: {name!r} is not a projection; choose from {TARGETS} or "
                       f"the groups {sorted(GROUPS)} (comma-separated).")
  if not chosen:
    raise ValueError(f"{field} is empty; name the projections to adapt, e.g. 'all'.")
  return tuple(t for t in TARGETS if t in chosen)


def names(target: str) -> tuple[str, str]:
  """The `Layers` attribute names of `target`'s adapter pair (A, B)."""
  return f"{target}_lora_a", f"{target}_lora_b"


def adapter_axes(target: str, projection_axes: tuple) -> tuple[tuple, tuple]:
  """Logical axes of (A, B), stacked: [layers, *in, rank] and [layers, rank, *out]."""
  split = 1 + NUM_IN.get(target, 1)  # `layers` and the input dimensions
  return projection_axes[:split] + (None,), (projection_axes[0], None) + projection_axes[split:]


def adapter_shapes(target: str, projection_shape: tuple[int, ...], rank: int
                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Shapes of (A, B) for a stacked projection of `projection_shape`."""
  split = 1 + NUM_IN.get(target, 1)
  return (projection_shape[:split] + (rank,),
          (projection_shape[0], rank) + projection_shape[split:])


def init_adapter(key: jax.Array, target: str, projection_shape: tuple[int, ...], rank: int,
                 dtype) -> tuple[jax.Array, jax.Array]:
  """Fresh (A, B): A uniform in +-1/sqrt(fan_in) (peft's `lora_A` init), B zero."""
  a_shape, b_shape = adapter_shapes(target, projection_shape, rank)
  fan_in = math.prod(a_shape[1:-1])
  bound = 1.0 / math.sqrt(fan_in)
  a = jax.random.uniform(key, a_shape, jnp.float32, -bound, bound).astype(dtype)
  return a, jnp.zeros(b_shape, dtype)


def delta(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """`scale * A @ B` of one stacked pair, in the projection's layout [layers, *in, *out]."""
  layers, rank = a.shape[0], a.shape[-1]
  in_shape, out_shape = a.shape[1:-1], b.shape[2:]
  product = jnp.einsum("lir,lro->lio", a.reshape(layers, -1, rank).astype(jnp.float32),
                       b.reshape(layers, rank, -1).astype(jnp.float32))
  return (scale * product).reshape(layers, *in_shape, *out_shape)


def trainable_filter(has_adapters: bool):
  """The nnx filter of what the trainer updates: with adapters, the adapters and a scalar
  head (a critic's value head starts fresh, so it must learn); else every parameter."""
  if not has_adapters:
    return nnx.Param
  return nnx.Any(Adapter, nnx.PathContains("scalar_head"))


def has_adapters(state: nnx.State) -> bool:
  """Whether `state` holds adapter weights."""
  return any(isinstance(v, Adapter) for v in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def split_trainable(state: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(trainable, frozen) parts of a model's parameters (`trainable_filter`).

  Without adapters the frozen part is empty, and the trainer updates every parameter, as
  it always has.
  """
  trainable, frozen = state.split(trainable_filter(has_adapters(state)), ...)
  return trainable, frozen


def merge(trainable: nnx.State, frozen: nnx.State) -> nnx.State:
  """The whole state again from `split_trainable`'s parts."""
  return nnx.State.merge(trainable, frozen)


def base_of(state: nnx.State) -> nnx.State:
  """The base model's parameters: `state` without its adapters (the same arrays)."""
  return state.split(Adapter, ...)[1]


def merged(state: nnx.State, config) -> nnx.State:
  """The base model's parameters with every adapter folded into its projection:
  `W + (alpha / rank) * A @ B` (what a Hugging Face export of the adapted model holds)."""
  base = jax.tree.map(lambda x: x, base_of(state))  # containers of its own
  if not has_adapters(state):
    return base
  layers = state["layers"]
  for target in config.lora_targets:
    a_name, b_name = names(target)
    w = base["layers"][target]
    update = delta(layers[a_name].get_value(), layers[b_name].get_value(), config.lora_scale)
    base["layers"][target] = w.replace(
        value=(w.get_value().astype(jnp.float32) + update).astype(w.get_value().dtype))
  return base


def with_adapters(base: nnx.State, config, seed: int) -> nnx.State:
  """`base`'s parameters (a model without adapters) with fresh adapters of `config`
  added: a model of `config` that computes what `base` computes.

  The base's arrays are shared, not copied: with adapters the trainer updates (and
  donates) the adapters only (`split_trainable`), so the base is never written.
  """
  if not config.lora_rank:
    raise ValueError("with_adapters needs a config with lora_rank > 0.")
  if has_adapters(base):
    raise ValueError("with_adapters: the base state already holds adapters.")
  out = jax.tree.map(lambda x: x, base)  # containers of its own, the same arrays
  keys = jax.random.split(jax.random.key(seed), len(config.lora_targets))
  for key, target in zip(keys, config.lora_targets):
    w = out["layers"][target]
    a, b = init_adapter(key, target, tuple(w.get_value().shape), config.lora_rank,
                        config.storage_dtype)
    a_axes, b_axes = adapter_axes(target, tuple(w.get_metadata()["axes"]))
    a_name, b_name = names(target)
    out["layers"][a_name] = Adapter(a, axes=a_axes)
    out["layers"][b_name] = Adapter(b, axes=b_axes)
  return out
