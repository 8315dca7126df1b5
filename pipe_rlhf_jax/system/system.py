"""The PPO system: three stages, their layouts, the models they hold, and weight sync.

This module owns the *what* of one PPO iteration — generate a rollout batch, turn it
into experience, update actor and critic, move the new weights to the stages that read
them — as methods that any schedule can call. `system/modes.py` owns the *when*: one
after another (`sequential`, `per_stage`) or concurrently on disjoint devices (`pipe`).

Every cross-mesh move (rollout gen -> infer, experience infer -> train, actor train ->
generate, critic train -> infer) goes through `parallel.reshard.reshard`, so bytes and
seconds are counted in the metrics.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from pipe_rlhf_jax.generation.sampler import SamplingParams
from pipe_rlhf_jax.parallel import logical
from pipe_rlhf_jax.parallel.mesh import MeshShape, make_mesh, split_devices
from pipe_rlhf_jax.parallel.reshard import TransferStats, reshard
from pipe_rlhf_jax.ppo.kl import adaptive_kl_coef
from pipe_rlhf_jax.ppo.types import Experience, Rollout
from pipe_rlhf_jax.stages.common import StageLayout
from pipe_rlhf_jax.stages.generate import GenerateStage
from pipe_rlhf_jax.stages.infer import InferHyper, InferStage
from pipe_rlhf_jax.stages.train import (ActorCriticState, PPOHyper, TrainStage,
                                        make_optimizer)

MODES = ("sequential", "per_stage", "pipe")
STAGES = ("generate", "infer", "train")


def build_layouts(config, devices=None) -> dict[str, StageLayout]:
  """Each stage's mesh and rules for `config.runtime.mode`.

  sequential: one mesh (`config.mesh`) over all devices, shared by every stage.
  per_stage: each stage's own `config.stages.<stage>.mesh` over all devices.
  pipe: devices split by `config.runtime.placement`, each stage's mesh on its subset.
  """
  devices = list(devices if devices is not None else jax.devices())
  mode = config.runtime.mode
  if mode not in MODES:
    raise ValueError(f"runtime.mode={mode!r}; choose one of {MODES}.")
  if mode == "sequential":
    mesh = make_mesh(MeshShape.from_config(config.mesh, len(devices), field="mesh"), devices)
    return {s: StageLayout(s, mesh, logical.DEFAULT_RULES) for s in STAGES}
  if mode == "per_stage":
    subsets = {s: devices for s in STAGES}
  else:
    placement = dict(config.runtime.placement)
    if set(placement) != set(STAGES):
      raise ValueError(f"runtime.placement must give device counts for exactly {STAGES}, "
                       f"got {sorted(placement)}.")
    if sum(placement.values()) > len(devices):
      raise ValueError(
          f"runtime.placement asks for {sum(placement.values())} devices "
          f"({placement}) but only {len(devices)} exist; shrink the counts.")
    subsets = split_devices(devices, {s: placement[s] for s in STAGES})
  layouts = {}
  for s in STAGES:
    stage_cfg = config.stages[s]
    shape = MeshShape.from_config(stage_cfg.mesh, len(subsets[s]), field=f"stages.{s}.mesh")
    rules = logical.rules_from_config(stage_cfg.get("rules"), logical.STAGE_RULES[s],
                                      field=f"stages.{s}.rules")
    layouts[s] = StageLayout(s, make_mesh(shape, subsets[s]), rules)
  if layouts["train"].mesh.shape.get("pipe", 1) > 1:
    raise ValueError("stages.train.mesh.pipe must be 1: training keeps the layer stack "
                     "whole; fold those devices into fsdp or data.")
  return layouts


def check_fits(layouts: dict[str, StageLayout], actor, critic) -> None:
  """Raises naming the stage's mesh field when a model cannot be split over it.

  Works on abstract parameters (`nnx.eval_shape`), so a run can check before it
  trains or compiles anything.
  """
  layouts["generate"].check_params(actor, "stages.generate.mesh")
  layouts["infer"].check_params(actor, "stages.infer.mesh")
  layouts["infer"].check_params(critic, "stages.infer.mesh")
  layouts["train"].check_params(actor, "stages.train.mesh")
  layouts["train"].check_params(critic, "stages.train.mesh")
  pipe = layouts["generate"].mesh.shape.get("pipe", 1)
  if pipe > 1:
    others = {k: v for k, v in layouts["generate"].mesh.shape.items()
              if k not in ("pipe", "tensor") and v > 1}
    if others:
      raise ValueError(f"stages.generate.mesh: with pipe={pipe} only 'pipe' and 'tensor' "
                       f"may exceed 1, got {others}; give the other devices to another "
                       "stage (runtime.placement).")


@dataclasses.dataclass
class Models:
  """The graph definitions and initial parameters of the four PPO models."""

  actor_graphdef: nnx.GraphDef
  critic_graphdef: nnx.GraphDef
  reward_graphdef: nnx.GraphDef | None
  actor: nnx.State
  reference: nnx.State
  critic: nnx.State
  reward: nnx.State | None


class PPOSystem:
  """Holds the stages and the state they own, and runs their steps.

  Args:
    config: the experiment config (ppo, runtime, stages, mesh fields are read).
    models: graph definitions and initial parameters.
    sampling: static generation settings.
    reward_fn / decode: the host-side rule reward, when `config.reward.fn` is a rule.
    eval_fn: a host-side rule reward logged as `rule_reward/mean` (never optimised).
    devices: devices to use (default: all).
  """

  def __init__(self, config, models: Models, sampling: SamplingParams,
               reward_fn: Callable | None = None, decode: Callable | None = None,
               eval_fn: Callable | None = None, devices=None):
    self.config = config
    ppo = config.ppo
    self.layouts = build_layouts(config, devices)
    self.mode = config.runtime.mode
    gen, inf, trn = (self.layouts[s] for s in STAGES)
    check_fits(self.layouts, models.actor, models.critic)
    num_mb = config.stages.generate.get("num_microbatches", 1) if self.mode != "sequential" else 1
    self.generate_stage = GenerateStage(gen, models.actor_graphdef, sampling, num_mb)
    self.infer_stage = InferStage(inf, models.actor_graphdef, models.critic_graphdef,
                                  models.reward_graphdef, InferHyper.from_config(ppo),
                                  reward_fn=reward_fn, eval_fn=eval_fn, decode=decode)
    total = ppo.steps
    actor_tx = make_optimizer(ppo.actor_lr, total_steps=total, warmup_steps=ppo.warmup_steps,
                              schedule=ppo.lr_schedule, max_grad_norm=ppo.max_grad_norm)
    critic_tx = make_optimizer(ppo.critic_lr, total_steps=total,
                               warmup_steps=ppo.warmup_steps, schedule=ppo.lr_schedule,
                               max_grad_norm=ppo.max_grad_norm)
    self.train_stage = TrainStage(trn, models.actor_graphdef, models.critic_graphdef,
                                  PPOHyper.from_config(ppo), actor_tx, critic_tx)
    self.reference, _ = inf.put_params(models.reference)
    self.reward = inf.put_params(models.reward)[0] if models.reward is not None else None
    self.state: ActorCriticState = self.train_stage.init_state(models.actor, models.critic)
    self.kl_coef = float(ppo.kl_coef)
    root = jax.random.key(config.seed)
    self.gen_key = jax.random.fold_in(root, 1)
    self.train_key = jax.random.fold_in(root, 2)
    self.version = 0  # number of PPO updates applied to the actor

  # ---- weight sync -------------------------------------------------------------------
  def actor_for_generation(self) -> tuple[nnx.State, TransferStats]:
    """The current actor moved to the generation layout (train -> generate)."""
    return self.layouts["generate"].put_params(self.state.actor)

  def critic_for_inference(self) -> tuple[nnx.State, TransferStats]:
    """The current critic moved to the inference layout (train -> infer)."""
    return self.layouts["infer"].put_params(self.state.critic)

  # ---- the three stage steps ---------------------------------------------------------
  def generate(self, actor: nnx.State, batch: dict, step: int, version: int
               ) -> tuple[Rollout, dict]:
    rng = jax.random.fold_in(self.gen_key, step)
    return self.generate_stage(actor, batch, rng, version)

  def infer(self, rollout: Rollout, critic: nnx.State) -> tuple[Experience, dict]:
    start = time.perf_counter()
    rollout, stats = reshard(rollout, self.layouts["infer"].batch_shardings(rollout))
    exp, metrics = self.infer_stage(self.reference, critic, self.reward, rollout,
                                    self.kl_coef)
    metrics = jax.device_get(metrics)
    return exp, {**{k: float(v) for k, v in metrics.items()},
                 **stats.as_metrics("transfer/rollout"),
                 "time/infer_s": time.perf_counter() - start}

  def train(self, exp: Experience, step: int) -> dict:
    start = time.perf_counter()
    exp, stats = reshard(exp, self.layouts["train"].batch_shardings(exp))
    rng = jax.random.fold_in(self.train_key, step)
    self.state, metrics = self.train_stage.update(self.state, exp, rng)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    self.version += 1
    return {**metrics, **stats.as_metrics("transfer/experience"),
            "time/train_s": time.perf_counter() - start}

  def update_kl(self, observed_kl: float) -> None:
    """Adaptive KL controller step (no-op unless `ppo.adaptive_kl`)."""
    ppo = self.config.ppo
    if ppo.adaptive_kl:
      self.kl_coef = float(adaptive_kl_coef(self.kl_coef, observed_kl, ppo.batch_size,
                                            ppo.kl_target, ppo.kl_horizon))

  # ---- checkpointed state ------------------------------------------------------------
  def checkpoint_state(self) -> dict[str, Any]:
    return {"trainer": self.state}

  def checkpoint_metadata(self) -> dict[str, Any]:
    return {"version": self.version, "kl_coef": self.kl_coef}

  def abstract_checkpoint_state(self) -> dict[str, Any]:
    return {"trainer": jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)}

  def restore(self, state: dict[str, Any], metadata: dict[str, Any]) -> None:
    self.state = state["trainer"]
    self.version = int(metadata["version"])
    self.kl_coef = float(metadata["kl_coef"])


def np_batch(batch: dict) -> dict:
  """Host copy of a data batch (grain may hand out views into reused buffers)."""
  return {k: np.array(v) for k, v in batch.items()}
