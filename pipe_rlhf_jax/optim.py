"""Optimizers of every training phase (SFT, reward model, PPO actor and critic).

Owns the optimizer recipe (AdamW, global-norm clipping, warmup + constant/cosine
schedule), the skip-if-non-finite update that keeps a bad step from touching parameters
or optimizer state, and the shardings of an optimizer state on a parameter layout.

The gradient's global norm is computed once per step (`apply_if_finite`) and serves
three readers: the finiteness test, the clipping and the logged metric; each would
otherwise be a pass of its own over a parameter-sized tree.
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
  return optax.chain(clip_by_global_norm(max_grad_norm),
                     optax.adamw(lr, weight_decay=weight_decay))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
  """`optax.clip_by_global_norm` with the same (empty) state, that takes the norm from
  its caller (`update(..., grad_norm=norm)`) when given instead of a pass of its own
  over the gradients, and clips by one scalar factor, `max_norm / norm`.

  The factor is optax's `(g / norm) * max_norm` up to rounding. A product with a scalar
  fuses into AdamW's own pass over each gradient, where optax's select between two
  per-element expressions ran as a pass of its own over every gradient: at SmolLM2-135M's
  shape the whole step (norm, finiteness, clipping, AdamW) takes 0.08-0.12 s per model
  this way, AdamW alone 0.07-0.10 s; with optax's clipping and a per-leaf finiteness test
  it took 0.28-0.33 s (donated state, 2-core AMD EPYC; `optimizer_seconds` in
  `experiments/common.py`, reported by `python -m experiments.bench_ppo_step --shapes`).
  """

  def init(params):
    del params
    return optax.EmptyState()

  def update(updates, state, params=None, *, grad_norm=None, **extra_args):
    del params, extra_args
    norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
    scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

  return optax.GradientTransformationExtraArgs(init, update)


def apply_if_finite(tx: optax.GradientTransformation, params, opt_state, grads, loss):
  """One optimizer step, or no change at all when the loss or a gradient is NaN/Inf.

  Finiteness is read off the gradient's global norm, which is also handed to the
  clipping (`clip_by_global_norm`) and returned for logging: one pass over the gradients
  for the three. A norm is non-finite exactly when a gradient is, or when the squares
  of finite gradients overflow (a norm above ~1.8e19 in f32): such a step is skipped too.

  A `lax.cond`, not a select of the new state against the old: the skipped branch returns
  its inputs (aliased, nothing computed) and the taken one writes the state once, where a
  select passes over every parameter and moment a second time.

  Returns:
    (params, opt_state, finite, grad_norm).
  """
  norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(norm)
  update = optax.with_extra_args_support(tx).update

  def step(params, opt_state, grads):
    updates, new_opt = update(grads, opt_state, params, grad_norm=norm)
    return optax.apply_updates(params, updates), new_opt

  def keep(params, opt_state, grads):
    del grads
    return params, opt_state

  new_params, new_opt = jax.lax.cond(finite, step, keep, params, opt_state, grads)
  return new_params, new_opt, finite, norm


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
