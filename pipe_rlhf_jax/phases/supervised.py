"""The supervised warm-start phases: SFT of the policy and the Bradley-Terry reward model.

Both are "loss over a batch, one optimizer step" loops; they share `fit`, which jits the
step once with the parameters and optimizer state donated, logs every step, and skips
(and counts) non-finite updates exactly like the PPO trainer.

They run on one layout of their own (`warm_start_layout`: `warm_start.mesh` over all the
job's devices, with the training rules), never on a PPO stage's mesh: the PPO plan
(`plan.mode`, placement, per-stage meshes) then cannot change the warm start, and runs
of one seed in different modes start PPO from the same weights, to the last bit.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from pipe_rlhf_jax.distributed.arrays import fetch
from pipe_rlhf_jax.metrics import ProgressBar, to_python
from pipe_rlhf_jax.optim import apply_if_finite, make_optimizer, optimizer_shardings
from pipe_rlhf_jax.parallel import logical
from pipe_rlhf_jax.parallel.mesh import MeshShape, describe, make_mesh
from pipe_rlhf_jax.stages.common import StageLayout, completion_nll, sequence_scores


def _warm_start_devices(devices: Sequence[Any], wanted: int) -> list:
  """The first `wanted` devices; in a multi-process job the first `wanted / processes` of
  each process (in process order), since every process takes part in the warm start's
  programs and a process without a device of the mesh could not."""
  devices = list(devices)
  processes = sorted({d.process_index for d in devices})
  if len(processes) == 1:
    return devices[:wanted]
  if wanted % len(processes):
    raise ValueError(
        f"warm_start.mesh needs {wanted} devices, which do not split evenly over the job's "
        f"{len(processes)} processes (each takes part in the warm start); use a multiple "
        f"of {len(processes)} devices, or -1 for all of them.")
  per = wanted // len(processes)
  return [d for p in processes for d in [d for d in devices if d.process_index == p][:per]]


def warm_start_layout(mesh: Any, devices: Sequence[Any], batch_sizes: dict[str, int]
                      ) -> StageLayout:
  """The one layout of the warm-start phases, whatever the PPO plan.

  Args:
    mesh: the `warm_start.mesh` mapping. With a -1 it spans all of `devices` ({"data": -1}:
      data parallel over the job); with explicit sizes only the first `product` devices
      ({"fsdp": 2}: devices 0-1; in a multi-process job as many from each process), which
      on a few CPU cores shared by many virtual devices is the faster choice for a small
      model (fewer threads to meet at every collective).
    devices: the job's devices (all of `plan.num_devices`).
    batch_sizes: {config field: batch size} of the phases, checked to split evenly.

  Returns:
    A `StageLayout` named "warm_start" with the training stage's logical rules.

  Raises:
    ValueError: naming `warm_start.mesh` when it does not fit the devices, or a batch
      size that does not split over its batch shards.
  """
  sizes = dict(mesh)
  explicit = all(v != -1 for v in sizes.values())
  wanted = int(np.prod(list(sizes.values()), dtype=np.int64)) if explicit else len(devices)
  if wanted > len(devices):
    raise ValueError(f"warm_start.mesh={sizes} needs {wanted} devices but the job has "
                     f"{len(devices)}; shrink it (or use -1 for all devices).")
  shape = MeshShape.from_config(sizes, wanted, field="warm_start.mesh")
  layout = StageLayout("warm_start", make_mesh(shape, _warm_start_devices(devices, wanted)),
                       logical.STAGE_RULES["train"])
  ways = layout.batch_ways()
  for field, size in batch_sizes.items():
    if size % ways:
      raise ValueError(f"{field}={size} does not split over the {ways} batch shards of the "
                       f"warm-start mesh ({describe(layout.mesh)}); make it a multiple of "
                       f"{ways}, or give warm_start.mesh fewer data/fsdp devices.")
  return layout


def sft_loss(graphdef: nnx.GraphDef) -> Callable:
  """Mean negative log-likelihood of the completion tokens (EOS included)."""

  def loss(params, batch):
    nll = completion_nll(graphdef, params, batch["prompt_tokens"], batch["prompt_mask"],
                         batch["completion_tokens"], batch["completion_mask"])
    return nll, {"loss": nll, "perplexity": jnp.exp(nll)}

  return loss


def preference_scores(graphdef, params, batch) -> tuple[jax.Array, jax.Array]:
  """Reward-model scores [batch] of the chosen and the rejected completion."""
  chosen = sequence_scores(graphdef, params, batch["prompt_tokens"], batch["prompt_mask"],
                           batch["chosen_tokens"], batch["chosen_mask"])
  rejected = sequence_scores(graphdef, params, batch["prompt_tokens"], batch["prompt_mask"],
                             batch["rejected_tokens"], batch["rejected_mask"])
  return chosen, rejected


def reward_model_loss(graphdef: nnx.GraphDef) -> Callable:
  """Bradley-Terry: -log sigmoid(r_chosen - r_rejected), with pairwise accuracy."""

  def loss(params, batch):
    chosen, rejected = preference_scores(graphdef, params, batch)
    margin = chosen - rejected
    bt = -jnp.mean(jax.nn.log_sigmoid(margin))
    return bt, {"loss": bt, "accuracy": jnp.mean((margin > 0).astype(jnp.float32)),
                "margin": jnp.mean(margin)}

  return loss


def fit(loss_fn: Callable, params: nnx.State, layout: StageLayout,
        batches: Iterator[dict], *, steps: int, learning_rate: float, warmup_steps: int,
        phase: str, writer=None, max_bad_steps: int = 3, start_step: int = 0,
        progress: bool = True) -> tuple[nnx.State, list[dict]]:
  """Runs `steps` optimizer steps of `loss_fn` on batches from `batches`.

  Args:
    loss_fn: (params, batch) -> (loss, aux dict of scalars).
    params: initial parameters (any layout; placed on `layout`).
    layout: the mesh and rules to train on.
    batches: iterator of host batches (dicts of numpy arrays).
    steps, learning_rate, warmup_steps: the schedule.
    phase: name used in metrics ("sft", "reward_model").
    writer: optional MetricsWriter.
    max_bad_steps: consecutive non-finite steps tolerated before stopping.
    start_step: offset for logged step numbers.
    progress: show a progress bar.

  Returns:
    The trained parameters (on `layout`) and the per-step metrics.
  """
  tx = make_optimizer(learning_rate, total_steps=steps, warmup_steps=warmup_steps)
  param_sh = layout.param_shardings(params)
  params, _ = layout.put_params(params)
  # The optimizer state's layout is pinned too, or the second call would see a new
  # input sharding and compile the step again.
  opt_sh = optimizer_shardings(tx, params, param_sh, layout.replicated)
  opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)

  def step(params, opt_state, batch):
    with layout.rules_context():
      (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
      params, opt_state, ok, norm = apply_if_finite(tx, params, opt_state, grads, loss)
      return params, opt_state, {**aux, "grad_norm": norm,
                                 "bad_update": 1.0 - ok.astype(jnp.float32)}

  step = jax.jit(step, donate_argnums=(0, 1),
                 out_shardings=(param_sh, opt_sh, layout.replicated))
  history, bad_streak = [], 0
  bar = ProgressBar(steps, desc=phase, keys=("loss", "accuracy"), disable=not progress)
  for i in range(steps):
    batch = layout.put_batch(next(batches))
    params, opt_state, metrics = step(params, opt_state, batch)
    metrics = to_python(metrics)
    history.append(metrics)
    bad_streak = bad_streak + 1 if metrics["bad_update"] else 0
    if bad_streak >= max_bad_steps:
      raise FloatingPointError(
          f"{phase}: {bad_streak} consecutive steps had a non-finite loss or gradient "
          f"(step {start_step + i}); lower {phase}.learning_rate or check the data.")
    if writer is not None:
      writer.write(start_step + i, metrics, phase=phase)
    bar.update(metrics)
    if not progress and (i + 1) % max(steps // 5, 1) == 0:
      shown = ", ".join(f"{k}={metrics[k]:.4g}" for k in ("loss", "accuracy") if k in metrics)
      print(f"[pipe_rlhf_jax] {phase} step {i + 1}/{steps}: {shown}", flush=True)
  bar.close()
  return params, history


def evaluate_reward_model(graphdef, params, layout: StageLayout, batches: Iterator[dict],
                          num_batches: int) -> dict:
  """Held-out pairwise accuracy and mean margin of the reward model."""

  @jax.jit
  def scores(params, batch):
    with layout.rules_context():
      return preference_scores(graphdef, params, batch)

  correct, margins = [], []
  for _ in range(num_batches):
    chosen, rejected = fetch(scores(params, layout.put_batch(next(batches))))
    correct.append(chosen > rejected)
    margins.append(chosen - rejected)
  correct, margins = np.concatenate(correct), np.concatenate(margins)
  return {"eval_accuracy": float(correct.mean()), "eval_margin": float(margins.mean()),
          "eval_pairs": int(correct.size)}
