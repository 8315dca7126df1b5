"""Optimizers of every training phase (SFT, reward model, PPO actor and critic).

Owns the optimizer recipe (AdamW, global-norm clipping, warmup + constant/cosine
schedule), the skip-if-non-finite update that keeps a bad step from touching parameters
or optimizer state, and the shardings of an optimizer state on a parameter layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def make_optimizer(learning_rate: float, *, total_steps: int, warmup_steps: int = 0,
                   schedule: str = "constant", max_grad_norm: float = 1.0,
                   weight_decay: float = 0.0) -> optax.GradientTransformation:
  """AdamW with global-norm clipping and a warmup + constant/cosine schedule."""
  warmup_steps = max(0, min(warmup_steps, total_steps - 1))
  if schedule == "constant":
    lr = optax.constant_schedule(learning_rate)
  elif schedule == "cosine":
    lr = optax.cosine_decay_schedule(learning_rate, max(total_steps - warmup_steps, 1))
  else:
    raise ValueError(f"lr_schedule={schedule!r}; choose 'constant' or 'cosine'.")
  if warmup_steps:
    # Linear from 0: step 0 takes no step, step `warmup_steps` the full rate.
    lr = optax.join_schedules(
        [optax.linear_schedule(0.0, learning_rate, warmup_steps), lr], [warmup_steps])
  return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                     optax.adamw(lr, weight_decay=weight_decay))


def tree_all_finite(tree) -> jax.Array:
  leaves = jax.tree.leaves(tree)
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def apply_if_finite(tx: optax.GradientTransformation, params, opt_state, grads, loss):
  """One optimizer step, or no change at all when the loss or a gradient is NaN/Inf.

  A `lax.cond`, not a select of the new state against the old: the skipped branch returns
  its inputs (aliased, nothing computed) and the taken one writes the state once, where a
  select passes over every parameter and moment a second time.
  """
  finite = jnp.isfinite(loss) & tree_all_finite(grads)

  def step(params, opt_state, grads):
    updates, new_opt = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_opt

  def keep(params, opt_state, grads):
    del grads
    return params, opt_state

  new_params, new_opt = jax.lax.cond(finite, step, keep, params, opt_state, grads)
  return new_params, new_opt, finite


def optimizer_shardings(tx: optax.GradientTransformation, params, param_shardings,
                        replicated):
  """Shardings of `tx.init(params)`: every params-shaped subtree (Adam moments) takes the
  parameters' shardings, every other leaf (step counts) is replicated."""
  param_struct = jax.tree.structure(param_shardings)
  is_params_like = lambda node: jax.tree.structure(node) == param_struct

  def per_node(node):
    if is_params_like(node):
      return param_shardings
    return jax.tree.map(lambda _: replicated, node)

  return jax.tree.map(per_node, jax.eval_shape(tx.init, params), is_leaf=is_params_like)
