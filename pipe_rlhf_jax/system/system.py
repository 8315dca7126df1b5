"""The PPO system: three stages, their layouts, the models they hold, and weight sync.

This module owns the *what* of one PPO iteration — generate a rollout batch, turn it
into experience, update actor and critic, move the new weights to the stages that read
them — as methods that any schedule can call. `system/modes.py` owns the *when*: one
after another (`sequential`, `per_stage`) or concurrently on disjoint devices (`pipe`).

Every cross-mesh move (rollout gen -> infer, experience infer -> train, actor train ->
generate, critic train -> infer) goes through `parallel.reshard.reshard`, so bytes and
seconds are counted in the metrics.

The system holds only the models its algorithm needs (`PPOSettings.needs_critic`,
`PPOSettings.needs_reference`): a critic-free estimator has no critic anywhere (nothing
built, placed, trained, synced or checkpointed), and `kl_coef = 0` no reference.

With `ppo.ptx_coef > 0` the system also holds a pool of demonstrations on the host
(`ptx_demos`) and hands each update the rows of its SFT term, drawn from the seed and the
PPO step alone, so every mode, and a resumed run, trains on the same rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any, Callable

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from pipe_rlhf_jax.checkpoint import CheckpointError
from pipe_rlhf_jax.config import STAGES, LoRASettings, Plan, PPOSettings
from pipe_rlhf_jax.distributed.arrays import fetch, put_global
from pipe_rlhf_jax.generation.sampler import SamplingSettings
from pipe_rlhf_jax.models import lora
from pipe_rlhf_jax.models.config import TransformerConfig
from pipe_rlhf_jax.models.transformer import init_model, with_execution
from pipe_rlhf_jax.optim import make_optimizer
from pipe_rlhf_jax.parallel import logical
from pipe_rlhf_jax.parallel.mesh import MeshShape, describe, make_mesh, split_devices
from pipe_rlhf_jax.parallel.reshard import TransferStats, reshard
from pipe_rlhf_jax.ppo.kl import adaptive_kl_coef
from pipe_rlhf_jax.ppo.types import Experience, Rollout
from pipe_rlhf_jax.stages.common import StageLayout
from pipe_rlhf_jax.stages.episodes import EpisodeRunner, EpisodeStage
from pipe_rlhf_jax.stages.generate import GenerateStage
from pipe_rlhf_jax.stages.infer import InferSettings, InferStage
from pipe_rlhf_jax.stages.rollout_stream import RolloutStream, split_data_state
from pipe_rlhf_jax.stages.train import ActorCriticState, PtxBatch, TrainSettings, TrainStage
from pipe_rlhf_jax.system.steps import BadStepGuard


def stage_mesh_shapes(plan: Plan, num_devices: int
                      ) -> dict[str, tuple[MeshShape, logical.Rules, list[int]]]:
  """Each stage's mesh shape, rules and device indices under `plan`; needs no devices.

  The device-free part of `build_layouts`, shared with the planner (which validates plans
  for device counts it does not have). Device indices are positions in the device list.
  """
  indices = list(range(num_devices))
  if plan.mode == "sequential":
    shape = MeshShape.from_config(plan.mesh.as_dict(), num_devices, field="mesh")
    return {s: (shape, logical.DEFAULT_RULES, indices) for s in STAGES}
  if plan.mode == "per_stage":
    subsets = {s: indices for s in STAGES}
  else:
    placement = dict(zip(STAGES, plan.placement))
    if sum(placement.values()) > num_devices:
      raise ValueError(
          f"plan.placement asks for {sum(placement.values())} devices "
          f"({placement}) but only {num_devices} exist; shrink the counts so that they "
          f"sum to at most {num_devices}.")
    # Training takes the last devices, whatever the count: a placement written for fewer
    # devices leaves the ones between inference and training unused, and on a
    # multi-process run training stays on process 0 (its devices come last:
    # `job.select_devices`), the process that writes the run's files.
    train = placement.pop("train")
    subsets = split_devices(indices[:num_devices - train], placement)
    subsets["train"] = indices[num_devices - train:]
  shapes = {}
  for s in STAGES:
    stage = plan.stage(s)
    shape = MeshShape.from_config(stage.mesh.as_dict(), len(subsets[s]),
                                  field=f"stages.{s}.mesh")
    rules = logical.rules_from_config(dict(stage.rules), logical.STAGE_RULES[s],
                                      field=f"stages.{s}.rules")
    shapes[s] = (shape, rules, subsets[s])
  return shapes


def build_layouts(plan: Plan, devices=None) -> dict[str, StageLayout]:
  """Each stage's mesh and rules under the plan `plan`.

  sequential: one mesh (`plan.mesh`) over all devices, shared by every stage.
  per_stage: each stage's own mesh over all devices.
  pipe: devices split by `plan.placement` (generation and inference from the first
    device on, training on the last ones), each stage's mesh on its block.
  """
  devices = list(devices if devices is not None else jax.devices())
  shapes = stage_mesh_shapes(plan, len(devices))
  if plan.mode == "sequential":
    shape, rules, _ = shapes[STAGES[0]]
    mesh = make_mesh(shape, devices)
    return {s: StageLayout(s, mesh, rules) for s in STAGES}
  return {s: StageLayout(s, make_mesh(shape, [devices[i] for i in subset]), rules)
          for s, (shape, rules, subset) in shapes.items()}


def check_fits(layouts: dict[str, StageLayout], actor, critic=None) -> None:
  """Raises naming the stage's mesh field when a model cannot be split over it.

  Works on abstract parameters (`nnx.eval_shape`), so a run can check before it
  trains or compiles anything. `critic` is None when the algorithm has none.
  """
  layouts["generate"].check_params(actor, "stages.generate.mesh")
  layouts["infer"].check_params(actor, "stages.infer.mesh")
  layouts["train"].check_params(actor, "stages.train.mesh")
  if critic is not None:
    layouts["infer"].check_params(critic, "stages.infer.mesh")
    layouts["train"].check_params(critic, "stages.train.mesh")
  pipeline = layouts["generate"].mesh.shape.get("pipeline", 1)
  if pipeline > 1:
    others = {k: v for k, v in layouts["generate"].mesh.shape.items()
              if k not in ("pipeline", "tensor") and v > 1}
    if others:
      raise ValueError(f"stages.generate.mesh: with pipeline={pipeline} only 'pipeline' and "
                       "'tensor' "
                       f"may exceed 1, got {others}; give the other devices to another "
                       "stage (plan.placement).")


def graphdef_of(cfg: TransformerConfig) -> nnx.GraphDef:
  """The static structure of a model, without allocating its parameters."""
  return nnx.split(nnx.eval_shape(lambda: init_model(cfg)))[0]


def with_backbone(target_cfg: TransformerConfig, source: nnx.State, seed: int) -> nnx.State:
  """A scalar-head model whose backbone is a copy of `source`'s (head freshly initialised).

  A real copy, not shared buffers: training steps donate their parameters, and a donated
  buffer shared with `source` would be deleted under the model that still owns it.
  """
  _, state = nnx.split(init_model(target_cfg, seed=seed))
  for key in ("embedding", "layers", "final_norm"):
    state[key] = jax.tree.map(jnp.copy, source[key])
  return state


def _shapes(state: nnx.State) -> Any:
  return jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), state)


def weights_fingerprint(state: nnx.State) -> str:
  """sha256 of a model's parameters (names, shapes, dtypes and bytes), one array on the
  host at a time: what a LoRA checkpoint records of the base its adapters were trained on.
  """
  digest = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    value = fetch(leaf)
    digest.update(f"{jax.tree_util.keystr(path)}:{value.shape}:{value.dtype}".encode())
    digest.update(np.ascontiguousarray(value).tobytes())
  return digest.hexdigest()


def check_batch_fits(layouts: dict[str, StageLayout], batch_size: int,
                     plan: Plan) -> None:
  """Raises naming the fields when a PPO batch cannot be split over a stage's batch axes."""
  # Micro-batches split generation only when it is pipelined (pipeline > 1).
  pipelined = layouts["generate"].mesh.shape.get("pipeline", 1) > 1
  for stage in STAGES:
    ways = layouts[stage].batch_ways()
    per_call = (batch_size // plan.num_microbatches if stage == "generate" and pipelined
                else batch_size)
    if per_call % ways:
      field = "mesh" if plan.mode == "sequential" else f"stages.{stage}.mesh"
      what = (f"ppo.batch_size={batch_size} / stages.generate.num_microbatches="
              f"{plan.num_microbatches}" if per_call != batch_size
              else f"ppo.batch_size={batch_size}")
      raise ValueError(f"{what} does not split over the {ways} batch shards of the "
                       f"{stage} stage ({describe(layouts[stage].mesh)}); make it a "
                       f"multiple of {ways}, or give {field} fewer data/fsdp devices.")


def ptx_rows_for(ppo: PPOSettings, train: StageLayout) -> int:
  """The SFT term's demonstrations per gradient step on the train stage's layout.

  `PPOSettings.ptx_rows_over` its batch shards: the default follows the layout; an explicit
  `ppo.ptx_batch_size` that does not split over the shards raises, naming the field.
  Checked by `PPOSystem` and, before any data are built, by the experiment's set-up.
  """
  ways = train.batch_ways()
  rows = ppo.ptx_rows_over(ways)
  if rows % ways:
    raise ValueError(
        f"ppo.ptx_batch_size: {rows} demonstrations per gradient step do not split over "
        f"the {ways} batch shards of the train stage ({describe(train.mesh)}); make it a "
        f"multiple of {ways}, or 0 (the minibatch size rounded up to one).")
  return rows


@dataclasses.dataclass
class Models:
  """The graph definitions and initial parameters of the PPO models.

  `reward` / `reward_graphdef` are None when the reward is a rule; `critic` /
  `critic_graphdef` when the advantage estimator needs no critic (grpo, rloo,
  reinforce_pp); `reference` when `ppo.kl_coef == 0`. Use `Models.from_policy` to derive
  the reference and critic from a policy.

  With LoRA adapters on the actor (its config's `lora_rank` > 0) the reference is the
  actor's base: its parameters without the adapters (`models.lora.base_of`), computed by
  the base model (`reference_graphdef`), the adapters switched off.
  """

  actor_graphdef: nnx.GraphDef
  critic_graphdef: nnx.GraphDef | None
  reward_graphdef: nnx.GraphDef | None
  actor: nnx.State
  reference: nnx.State | None
  critic: nnx.State | None
  reward: nnx.State | None

  @property
  def actor_config(self) -> TransformerConfig:
    return nnx.merge(self.actor_graphdef, self.actor).config

  @property
  def reference_graphdef(self) -> nnx.GraphDef:
    """The graph of the model that computes the reference: the actor's, or its base
    model's when the actor carries adapters."""
    config = self.actor_config
    return graphdef_of(config.base) if config.lora_rank else self.actor_graphdef

  @classmethod
  def from_policy(cls, policy: nnx.Module, *, reward_model: nnx.Module | None = None,
                  critic_from: str | None = "policy", reference: bool = True,
                  seed: int = 0, lora_settings: LoRASettings | None = None) -> "Models":
    """Actor = reference = `policy`; critic = its backbone with a fresh value head.

    Args:
      policy: a `models.Transformer` with an LM head (e.g. `hf.from_pretrained(path)`).
      reward_model: a Transformer with a score head, or None for a rule reward.
      critic_from: "policy" or "reward_model": whose backbone the critic starts from;
        None builds no critic (for a critic-free `ppo.advantage_estimator`).
      reference: keep a copy of `policy` as the frozen reference (False when
        `ppo.kl_coef == 0`, which uses none).
      seed: seed of the critic's fresh value head (and of the fresh adapters).
      lora_settings: LoRA adapters on the actor and the critic (`LoRASettings`, rank > 0):
        they start as the policy (B = 0) and are what PPO trains; the reference is then
        the policy itself, without adapters, and shares its arrays.
    """
    if policy.config.head != "lm":
      raise ValueError(f"policy has a {policy.config.head!r} head; the actor needs 'lm'.")
    actor_gd, actor = nnx.split(policy)
    reward_gd = reward = None
    if reward_model is not None:
      if reward_model.config.head != "score":
        raise ValueError(f"reward_model has a {reward_model.config.head!r} head; a reward "
                         "model needs 'score' (models.hf.from_pretrained(path, head='score')).")
      reward_gd, reward = nnx.split(reward_model)
    if critic_from not in ("policy", "reward_model", None):
      raise ValueError(f"critic_from={critic_from!r}; choose 'policy', 'reward_model' or "
                       "None (no critic).")
    if critic_from == "reward_model" and reward_model is None:
      raise ValueError("critic_from='reward_model' needs a reward_model.")
    critic_gd = critic = None
    if critic_from is not None:
      source_cfg, source = ((policy.config, actor) if critic_from == "policy"
                            else (reward_model.config, reward))
      critic_cfg = source_cfg.replace(head="value")
      critic_gd, critic = graphdef_of(critic_cfg), with_backbone(critic_cfg, source, seed)
    adapted = lora_settings is not None and lora_settings.rank > 0
    # With adapters the reference becomes the adapted actor's base (`with_adapters`), the
    # same arrays: no copy of the whole model to make.
    ref = (actor if adapted else jax.tree.map(jnp.copy, actor)) if reference else None
    models = cls(actor_graphdef=actor_gd, critic_graphdef=critic_gd,
                 reward_graphdef=reward_gd, actor=actor, reference=ref,
                 critic=critic, reward=reward)
    return models.with_adapters(lora_settings, seed) if lora_settings else models

  def with_adapters(self, settings: LoRASettings, seed: int) -> "Models":
    """These models with fresh LoRA adapters on the actor and the critic (`settings`;
    unchanged at rank 0): they compute what they computed, and PPO trains the adapters
    (and the critic's value head). The reference becomes the actor's base, the same
    arrays (`models.lora.base_of`)."""
    if not settings.rank:
      return self
    if lora.has_adapters(self.actor):
      raise ValueError("Models.with_adapters: the actor already carries adapters.")
    actor_cfg = settings.apply(self.actor_config)
    actor = lora.with_adapters(self.actor, actor_cfg, seed)
    critic_gd, critic = self.critic_graphdef, self.critic
    if critic is not None:
      critic_cfg = settings.apply(nnx.merge(critic_gd, critic).config)
      critic_gd = graphdef_of(critic_cfg)
      critic = lora.with_adapters(critic, critic_cfg, seed + 1)
    return dataclasses.replace(
        self, actor_graphdef=graphdef_of(actor_cfg), actor=actor, critic_graphdef=critic_gd,
        critic=critic, reference=lora.base_of(actor) if self.reference is not None else None)

  def check(self, sampling: SamplingSettings, ppo: PPOSettings | None = None) -> None:
    """Raises when the models disagree with each other, with the sampling settings, or
    (given `ppo`) with what the algorithm needs: a critic exactly for an estimator that
    reads values, a reference exactly when kl_coef > 0."""
    for name in ("critic", "reward"):
      if (getattr(self, name) is None) != (getattr(self, name + "_graphdef") is None):
        raise ValueError(f"Models.{name} and Models.{name}_graphdef must both be set or "
                         "both be None.")
    if ppo is not None:
      self._check_algorithm(ppo)
    heads = {"actor": (self.actor_graphdef, "lm")}
    if self.critic_graphdef is not None:
      heads["critic"] = (self.critic_graphdef, "value")
    if self.reward_graphdef is not None:
      heads["reward"] = (self.reward_graphdef, "score")
    for name, (graphdef, head) in heads.items():
      got = nnx.merge(graphdef, getattr(self, name)).config.head
      if got != head:
        raise ValueError(f"Models.{name} has a {got!r} head; it needs {head!r}.")
    if self.reference is not None and (_shapes(self.reference)
                                       != _shapes(lora.base_of(self.actor))):
      raise ValueError("Models.reference does not have the actor's parameter shapes and "
                       "dtypes (without its adapters); the reference must be a copy of the "
                       "initial actor's base.")
    vocab = self.actor_config.vocab_size
    for name in ("eos_id", "pad_id"):
      token = getattr(sampling, name)
      if token is not None and not 0 <= token < vocab:
        raise ValueError(f"sampling.{name}={token} is outside the actor's vocabulary "
                         f"(size {vocab}).")


  def _check_algorithm(self, ppo: PPOSettings) -> None:
    estimator = f"ppo.advantage_estimator={ppo.advantage_estimator!r}"
    if ppo.needs_critic and self.critic is None:
      raise ValueError(f"{estimator} needs a critic but Models has none; build it with "
                       "Models.from_policy(..., critic_from='policy').")
    if not ppo.needs_critic and self.critic is not None:
      raise ValueError(f"{estimator} uses no critic but Models has one; build Models "
                       "with Models.from_policy(..., critic_from=None).")
    if ppo.needs_reference and self.reference is None:
      raise ValueError(f"ppo.kl_coef={ppo.kl_coef} needs the reference policy but Models "
                       "has none; build Models.from_policy(..., reference=True).")
    if not ppo.needs_reference and self.reference is not None:
      raise ValueError("ppo.kl_coef=0 uses no reference policy but Models has one; build "
                       "Models.from_policy(..., reference=False).")


# Keys the host's draws of SFT-term rows, apart from every jax.random stream.
_PTX_STREAM = 0x707478

PTX_FIELDS = ("prompt_tokens", "prompt_mask", "completion_tokens", "completion_mask")


def check_ptx_demos(demos: dict[str, np.ndarray] | None, ppo: PPOSettings
                    ) -> dict[str, np.ndarray] | None:
  """The SFT term's pool as host arrays, or a ValueError naming what is wrong."""
  if not ppo.ptx_coef:
    if demos is not None:
      raise ValueError("ptx_demos given with ppo.ptx_coef=0: the SFT term is off, so they "
                       "would be unused; set ppo.ptx_coef > 0 or pass ptx_demos=None.")
    return None
  if demos is None:
    raise ValueError(f"ppo.ptx_coef={ppo.ptx_coef} needs demonstrations for its SFT term: "
                     "pass PPOSystem(ptx_demos=...) (the main job uses the SFT "
                     "data), or set ppo.ptx_coef=0.")
  missing = sorted(set(PTX_FIELDS) - set(demos))
  if missing:
    raise ValueError(f"ptx_demos lacks {missing}; it needs {list(PTX_FIELDS)}.")
  demos = {k: np.asarray(demos[k], bool if k.endswith("mask") else np.int32)
           for k in PTX_FIELDS}
  pool = len(demos["completion_tokens"])
  for kind in ("prompt", "completion"):
    tokens, mask = demos[f"{kind}_tokens"], demos[f"{kind}_mask"]
    if tokens.ndim != 2 or tokens.shape != mask.shape or len(tokens) != pool:
      raise ValueError(f"ptx_demos {kind}_tokens {tokens.shape} and {kind}_mask "
                       f"{mask.shape} must both be [pool={pool}, length].")
  if pool == 0 or not demos["completion_mask"].any(axis=1).all():
    raise ValueError("ptx_demos needs at least one demonstration, each with a completion "
                     "token in its mask.")
  return demos


class PPOSystem:
  """Holds the stages and the state they own, and runs their steps.

  Args:
    models: graph definitions and initial parameters.
    ppo: the algorithm settings.
    sampling: generation settings; the trainer's log-probs use its temperature.
    plan: the plan (mode, placement, per-stage meshes); default: sequential on all
      devices.
    reward_fn: host-side rule reward `(prompts: list[str], completions: list[str]) ->
      float32 [batch]`, when `models` has no reward model. Needs `decode`.
    decode: token ids -> text, for rule rewards.
    eval_fn: a host-side rule reward logged as `rule_reward/mean` (never optimised).
    devices: devices to use (default: all).
    ptx_demos: the demonstrations of the SFT term, exactly when `ppo.ptx_coef > 0`:
      {"prompt_tokens", "prompt_mask", "completion_tokens", "completion_mask"} host arrays
      [pool, ...] in the `DemoLoader` layout (e.g. `DemoLoader.as_arrays()`).
  """

  def __init__(self, models: Models, *, ppo: PPOSettings, sampling: SamplingSettings,
               plan: Plan = Plan(), reward_fn: Callable | None = None,
               decode: Callable | None = None, eval_fn: Callable | None = None,
               devices=None, ptx_demos: dict[str, np.ndarray] | None = None,
               episodes: EpisodeRunner | None = None):
    if (reward_fn is not None) + (models.reward is not None) + (episodes is not None) != 1:
      raise ValueError("Give exactly one reward: a reward model in Models.reward, a rule "
                       "reward_fn, or an environment's (episodes=EpisodeRunner(...)).")
    if episodes is not None and plan.partial_rollouts:
      raise ValueError("plan.partial_rollouts=True with env.name set: an episode's turns "
                       "are sampled one engine call each, so unfinished rows are not kept "
                       "across updates; set plan.partial_rollouts=False.")
    if (reward_fn is not None or eval_fn is not None) and decode is None:
      raise ValueError("A rule reward (reward_fn / eval_fn) scores decoded text: pass "
                       "decode=tokenizer.decode.")
    models.check(sampling, ppo)
    self.ptx_demos = check_ptx_demos(ptx_demos, ppo)
    self.ppo = ppo
    self.sampling = sampling
    self.plan = plan
    self.layouts = build_layouts(plan, devices)
    self.mode = plan.mode
    # In a multi-process job a process holds (and initialises) only the stages that have
    # devices in it; `pipe_processes` moves everything else between processes.
    me = jax.process_index()
    self.local_stages = tuple(s for s in STAGES if any(
        d.process_index == me for d in self.layouts[s].mesh.devices.flat))
    # What the trainer updates and publishes (`models.lora.split_trainable`): the whole
    # models, or their adapters when they carry some.
    self._abstract = {name: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                         lora.split_trainable(getattr(models, name))[0]
                                         if getattr(models, name) is not None else None)
                      for name in ("actor", "critic")}
    gen, inf, trn = (self.layouts[s] for s in STAGES)
    check_fits(self.layouts, models.actor, models.critic)
    check_batch_fits(self.layouts, ppo.batch_size, plan)
    ptx_rows = ptx_rows_for(ppo, self.layouts["train"])
    self.has_critic = models.critic is not None
    # Rows of the policy's embedding: prompts with ids past it are refused as they enter.
    self.vocab_size = nnx.merge(models.actor_graphdef, models.actor).config.vocab_size
    # Each stage computes the same models its own way (attention kernel, remat, layer
    # scan: unrolled unless its mesh shards the weights over fsdp, `StagePlan.unroll_for`).
    def for_stage(stage, graphdef, params):
      fsdp = self.layouts[stage].mesh.shape.get("fsdp", 1)
      return with_execution(graphdef, params, **plan.stage(stage).execution(fsdp))

    reward_graphdef = (for_stage("infer", models.reward_graphdef, models.reward)
                       if models.reward is not None else None)
    critic_graphdef = {stage: (for_stage(stage, models.critic_graphdef, models.critic)
                               if self.has_critic else None) for stage in ("infer", "train")}
    generate_args = (gen, for_stage("generate", models.actor_graphdef, models.actor),
                     sampling, plan.num_microbatches)
    self.episodes = episodes
    self.generate_stage = (
        GenerateStage(*generate_args, group_size=ppo.group_size,
                      num_slots=plan.generate.num_slots,
                      prefill_chunk=plan.generate.prefill_chunk) if episodes is None else
        EpisodeStage(*generate_args, ppo.group_size, plan.generate.num_slots, episodes,
                     plan.generate.prefill_chunk))
    reference = models.reference if models.reference is not None else models.actor
    self.infer_stage = InferStage(inf, for_stage("infer", models.reference_graphdef, reference),
                                  critic_graphdef["infer"], reward_graphdef,
                                  InferSettings.from_settings(ppo, sampling.temperature),
                                  reward_fn=reward_fn, eval_fn=eval_fn, decode=decode,
                                  pack_tokens=plan.infer.pack_tokens,
                                  env_rewards=episodes is not None)
    optimizer = lambda lr: make_optimizer(lr, total_steps=ppo.steps,
                                          warmup_steps=ppo.warmup_steps,
                                          schedule=ppo.lr_schedule,
                                          max_grad_norm=ppo.max_grad_norm)
    self.train_stage = TrainStage(trn, for_stage("train", models.actor_graphdef, models.actor),
                                  critic_graphdef["train"],
                                  dataclasses.replace(
                                      TrainSettings.from_settings(ppo, sampling.temperature),
                                      ptx_rows=ptx_rows),
                                  optimizer(ppo.actor_lr),
                                  optimizer(ppo.critic_lr) if self.has_critic else None,
                                  pack_tokens=plan.train.pack_tokens)
    # With adapters, checkpoints hold them alone: they name the base they belong to.
    self.base_fingerprint = (weights_fingerprint(lora.base_of(models.actor))
                             if lora.has_adapters(models.actor) else None)
    self.reference = self.reward = self.state = None
    # The frozen parts of the models where each stage reads them: the actor's on the
    # generation layout, the critic's on the inference layout (empty without adapters).
    # Weight sync then moves the trainable parts only and completes them here. Each stage
    # places them from the copy the stage before it placed: where two stages lay them out
    # alike (`sequential`: one mesh), the arrays pass through unmoved and the stages
    # share one copy; the LoRA reference is the generation stage's base itself.
    self._frozen: dict[str, nnx.State] = {}
    actor_parts = lora.split_trainable(models.actor)
    critic_parts = lora.split_trainable(models.critic) if self.has_critic else None
    if "generate" in self.local_stages:
      self._frozen["actor"] = gen.put_params(actor_parts[1])[0]
      actor_parts = (actor_parts[0], self._frozen["actor"])
    if "infer" in self.local_stages:
      if self.has_critic:
        self._frozen["critic"] = inf.put_params(critic_parts[1])[0]
        critic_parts = (critic_parts[0], self._frozen["critic"])
      reference = models.reference
      if reference is not None and lora.has_adapters(models.actor):
        reference = actor_parts[1]  # the base: everything of the actor but its adapters
      self.reference = inf.put_params(reference)[0] if reference is not None else None
      self.reward = inf.put_params(models.reward)[0] if models.reward is not None else None
    if "train" in self.local_stages:
      self.state: ActorCriticState = self.train_stage.init_state(
          lora.merge(*actor_parts),
          lora.merge(*critic_parts) if critic_parts is not None else None)
    root = jax.random.key(ppo.seed)
    self.gen_key = jax.random.fold_in(root, 1)
    # Prompts a restored checkpoint held in flight (partial rollouts): the next
    # `rollout_stream` queues them first.
    self.in_flight: list[dict] = []
    self._stream: RolloutStream | None = None
    self.train_key = jax.random.fold_in(root, 2)
    self.version = 0  # number of PPO updates applied to the actor
    # The KL coefficient of each policy version: rewards of a rollout sampled by version
    # v use kl_coefs[v], whichever thread computes them and whenever. Written by the
    # trainer before it publishes version v, so a reader always finds it.
    self.kl_coefs: dict[int, float] = {0: float(ppo.kl_coef)}
    # Consecutive and total skipped updates, checkpointed with the state.
    self.guard = BadStepGuard(ppo.max_bad_steps)

  def abstract_params(self) -> dict[str, nnx.State]:
    """Shapes and dtypes (with logical-axis metadata) of what weight sync moves of the
    actor and the critic: their trainable parameters."""
    return self._abstract

  def with_frozen(self, name: str, trainable: nnx.State) -> nnx.State:
    """The whole `name` ("actor" or "critic") from its trainable parameters, already on
    the stage that reads it (generation, inference), and that stage's frozen ones."""
    return lora.merge(trainable, self._frozen[name])

  def trained_actor(self) -> nnx.State:
    """The trainer's current actor, whole, on the training layout."""
    return lora.merge(self.state.actor, self.train_stage.frozen.actor)

  @property
  def kl_coef(self) -> float:
    """The KL coefficient of the current policy version."""
    return self.kl_coefs[self.version]

  # ---- weight sync -------------------------------------------------------------------
  def actor_for_generation(self) -> tuple[nnx.State, TransferStats]:
    """The current actor on the generation layout (train -> generate): its trainable
    parameters moved (the adapters only, with LoRA), the frozen ones already there."""
    moved, stats = self.layouts["generate"].put_params(self.state.actor)
    return self.with_frozen("actor", moved), stats

  def critic_for_inference(self) -> tuple[nnx.State | None, TransferStats]:
    """The current critic moved to the inference layout (train -> infer); (None, nothing
    moved) without a critic."""
    if not self.has_critic:
      return None, TransferStats()
    moved, stats = self.layouts["infer"].put_params(self.state.critic)
    return self.with_frozen("critic", moved), stats

  # ---- the three stage steps ---------------------------------------------------------
  def generate(self, actor: nnx.State, batch: dict, step: int, version: int
               ) -> tuple[Rollout, dict]:
    size = len(batch["prompt_tokens"])
    if size != self.ppo.prompts_per_step:
      per_step = (f"ppo.batch_size={self.ppo.batch_size}" if self.ppo.group_size == 1 else
                  f"ppo.batch_size / ppo.group_size = {self.ppo.batch_size} / "
                  f"{self.ppo.group_size} = {self.ppo.prompts_per_step}")
      raise ValueError(f"The prompt source gave a batch of {size} prompts at step {step}; "
                       f"{per_step}: make them equal.")
    rng = jax.random.fold_in(self.gen_key, step)
    return self.generate_stage(actor, batch, rng, version)

  def trace_generation(self, tracer, step: int) -> None:
    """Draws the last `generate` call's engine slots under its span in `tracer` (nothing
    for a static batch or the pipelined decoder; `GenerateStage.trace_slots`)."""
    self.generate_stage.trace_slots(tracer, batch=step)

  def rollout_stream(self) -> RolloutStream:
    """The generation stage's engine kept across steps (`plan.partial_rollouts`),
    holding first the prompts a restored checkpoint had in flight. One per system: a
    second `run` continues the rows the first left decoding."""
    if self._stream is None:
      self._stream = RolloutStream(self.generate_stage, self.ppo.batch_size, self.gen_key,
                                   max_staleness=self.plan.max_staleness,
                                   past_staleness=self.plan.past_staleness,
                                   in_flight=self.in_flight)
      self.in_flight = []
    return self._stream

  def infer(self, rollout: Rollout, critic: nnx.State | None, *, actor_version: int,
            critic_version: int | None) -> tuple[Experience, dict]:
    """Experience of a rollout sampled by policy `actor_version`, valued by that critic
    (`critic` None and `critic_version` not reported without a critic).

    Its KL coefficient is the one of `actor_version` (recorded as `kl_coef`).
    """
    start = time.perf_counter()
    kl_coef = self.kl_coefs[actor_version]
    rollout, stats = reshard(rollout, self.layouts["infer"].batch_shardings(rollout))
    exp, metrics = self.infer_stage(self.reference, critic, self.reward, rollout, kl_coef)
    metrics = fetch(metrics)
    versions = {"version/actor": float(actor_version)}
    if self.has_critic:
      versions["version/critic"] = float(critic_version)
    return exp, {**{k: float(v) for k, v in metrics.items()},
                 **stats.as_metrics("transfer/rollout"), "kl_coef": kl_coef, **versions,
                 "time/infer_s": time.perf_counter() - start}

  def train(self, exp: Experience, step: int, *, observed_kl: float) -> dict:
    """One PPO update, committed together with its version.

    `observed_kl` is the KL of the batch the update trains on (its experience's
    `kl/mean`), from which an adaptive KL controller sets the new version's coefficient.

    The trainer state and `version` change in one place, after the update's metrics are
    on the host: until then `state` is the pre-update state's (donated) buffers and
    `version` its version, and nothing may read either. A schedule therefore only ever
    sees, and a checkpoint only ever holds, a state whose version counts exactly the
    updates in it; afterwards the new version's KL coefficient is known.
    """
    start = time.perf_counter()
    exp, stats = reshard(exp, self.layouts["train"].batch_shardings(exp))
    rng = jax.random.fold_in(self.train_key, step)
    state, metrics = self.train_stage.update(self.state, exp, rng, self.ptx_batch(step))
    metrics = {k: float(v) for k, v in fetch(metrics).items()}
    self._commit(state, observed_kl)
    return {**metrics, **stats.as_metrics("transfer/experience"),
            "time/train_s": time.perf_counter() - start}

  def ptx_batch(self, step: int) -> PtxBatch | None:
    """The demonstrations of update `step`'s SFT term on the training mesh (None without
    one): uniform draws with replacement from `ptx_demos`, keyed by (seed, step) only."""
    if self.ptx_demos is None:
      return None
    pool = len(self.ptx_demos["completion_tokens"])
    shape = self.train_stage.ptx_shape(self.ppo.batch_size)
    rows = np.random.default_rng((self.ppo.seed, _PTX_STREAM, step)).integers(0, pool, shape)
    batch = PtxBatch(**{k: v[rows] for k, v in self.ptx_demos.items()})
    # Every process draws the same rows; each uploads its devices' copies.
    return put_global(batch, self.layouts["train"].replicated)

  def _commit(self, state: ActorCriticState, observed_kl: float) -> None:
    """Makes `state` (the update just applied) current as a new version, and fixes that
    version's KL coefficient (the adaptive controller's step on the KL observed in the
    batch that produced it; unchanged unless `ppo.adaptive_kl`)."""
    coef = self.kl_coefs[self.version]
    if self.ppo.adaptive_kl:
      coef = float(adaptive_kl_coef(coef, observed_kl, self.ppo.batch_size,
                                    self.ppo.kl_target, self.ppo.kl_horizon))
    self.kl_coefs[self.version + 1] = coef
    # Older versions can no longer be sampled from (staleness is bounded).
    for old in [v for v in self.kl_coefs if v < self.version - 64]:
      del self.kl_coefs[old]
    self.state = state
    self.version += 1

  # ---- checkpointed state ------------------------------------------------------------
  def checkpoint_state(self) -> dict[str, Any]:
    return {"trainer": self.state}

  def checkpoint_metadata(self) -> dict[str, Any]:
    meta = {"version": self.version, "kl_coef": self.kl_coef,
            "bad_steps": self.guard.state()}
    if self.base_fingerprint is not None:
      meta["base_fingerprint"] = self.base_fingerprint
    return meta

  def abstract_checkpoint_state(self) -> dict[str, Any]:
    return {"trainer": jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)}

  def restore(self, state: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Continues from a checkpoint; rollouts in flight are re-generated from its policy,
    so only the current version's KL coefficient is needed.

    With adapters, the checkpoint's base must be this system's (`base_fingerprint`): its
    adapters mean nothing on other weights.
    """
    if metadata.get("base_fingerprint") != self.base_fingerprint:
      raise CheckpointError(
          "the checkpoint's base_fingerprint is "
          f"{str(metadata.get('base_fingerprint'))[:12]}, this run's base weights "
          f"{str(self.base_fingerprint)[:12]}: the adapters were trained on another base "
          "(with lora.rank > 0 a PPO checkpoint holds the adapters only). Resume with the "
          "model file and warm start they were trained on, or use a new workdir.")
    self.state = state["trainer"]
    self.version = int(metadata["version"])
    self.kl_coefs = {self.version: float(metadata["kl_coef"])}
    self.in_flight = split_data_state(metadata.get("data_state"))[1]
    self._stream = None  # the restored prompts go to a new engine
    self.guard.restore(metadata.get("bad_steps"))
