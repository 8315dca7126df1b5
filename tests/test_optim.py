"""Non-finite updates are skipped inside the jitted step and stop the run when repeated."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pipe_rlhf_jax.optim import apply_if_finite, clip_by_global_norm, make_optimizer
from pipe_rlhf_jax.system.steps import BadStepGuard


def test_nan_gradient_leaves_params_and_optimizer_untouched():
  tx = make_optimizer(1e-2, total_steps=10)
  params = {"w": jnp.ones((3,)), "b": jnp.zeros(())}
  opt = tx.init(params)
  grads = {"w": jnp.array([1.0, jnp.nan, 0.0]), "b": jnp.ones(())}
  new_params, new_opt, ok, _ = jax.jit(apply_if_finite, static_argnums=0)(
      tx, params, opt, grads, jnp.float32(0.5))
  assert not bool(ok)
  jax.tree.map(np.testing.assert_array_equal, new_params, params)
  jax.tree.map(np.testing.assert_array_equal, new_opt, opt)
  # A finite step does move the parameters.
  grads = {"w": jnp.ones((3,)), "b": jnp.ones(())}
  new_params, _, ok, norm = apply_if_finite(tx, params, opt, grads, jnp.float32(0.5))
  assert bool(ok) and not np.allclose(new_params["w"], params["w"])
  np.testing.assert_allclose(norm, 2.0)


def test_infinite_loss_is_a_bad_step_too():
  tx = optax.sgd(0.1)
  params = {"w": jnp.ones((2,))}
  _, _, ok, _ = apply_if_finite(tx, params, tx.init(params), {"w": jnp.ones((2,))},
                             jnp.float32(jnp.inf))
  assert not bool(ok)


@pytest.mark.parametrize("scale", [0.1, 10.0])
def test_clipping_on_the_callers_norm_equals_optax(scale):
  """The recipe's clipping takes the norm apply_if_finite computed; below and above the
  threshold it gives optax's values (up to rounding: one scalar factor), and its state is
  optax's, so optimizer states saved by either restore into the other."""
  grads = {"w": scale * jnp.arange(1.0, 4.0), "b": scale * jnp.ones(())}
  params = jax.tree.map(jnp.zeros_like, grads)
  ours, theirs = clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)
  assert jax.tree.structure(ours.init(params)) == jax.tree.structure(theirs.init(params))
  expected, _ = theirs.update(grads, theirs.init(params))
  given, _ = ours.update(grads, ours.init(params), grad_norm=optax.tree.norm(grads))
  computed, _ = ours.update(grads, ours.init(params))
  for got in (given, computed):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, expected)
  tx = make_optimizer(1e-2, total_steps=10)
  reference = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  new, _, ok, norm = apply_if_finite(tx, params, tx.init(params), grads, jnp.float32(0.0))
  updates, _ = reference.update(grads, reference.init(params), params)
  assert bool(ok)
  np.testing.assert_allclose(norm, optax.tree.norm(grads), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), new,
               optax.apply_updates(params, updates))


def test_guard_stops_after_k_consecutive_bad_steps_and_counts_them():
  guard = BadStepGuard(limit=3)
  metrics = [{"bad_updates": b} for b in (1.0, 0.0, 2.0, 1.0)]
  for step, m in enumerate(metrics):
    guard.check(step, m)
  assert metrics[-1]["bad_steps_total"] == 3.0
  with pytest.raises(FloatingPointError, match="3 consecutive steps.*ppo.max_bad_steps"):
    guard.check(4, {"bad_updates": 1.0})
