"""The memory model against XLA's own accounting, and the fit check's reasons.

XLA CPU `memory_analysis()` peak per device (arguments + outputs + temporaries - aliased)
of the real programs, against `memory.stage_memory` (model / XLA), measured here:
  train (the PPO update of actor + critic), activation-dominated (embed 128, vocab 264,
  minibatch 32 x 24 tokens, 4 layers): remat none 0.95, save_matmuls 1.12, full 0.98;
  2 layers 0.89, minibatch 16 1.00. Parameter-dominated (embed 256, vocab 8192,
  minibatch 4): single 1.05, full remat 1.02, fsdp=4 x tensor=2 0.94, data=8 0.96. With
  LoRA adapters (rank 8 on every projection; minibatch 8, single device): 1.08 (102 MiB
  modelled, XLA 94 MiB; the whole model's update of that case: 288 and 211 MiB).
  infer (reference, critic, reward model forwards + GAE): activation-dominated 1.01;
  parameter-dominated single 1.03, fsdp=4 x tensor=2 0.85, data=8 0.97.
  generate (prefill; the decode loop donates its cache and peaks lower):
  activation-dominated 1.16; parameter-dominated single 1.02, fsdp=4 x tensor=2 0.76,
  data=8 0.92.
(The first version of the model was 0.40 / 0.70 on the activation-dominated update: it
counted a third of each layer's residuals and one model's instead of both.) The tests
hold a spread of these to 25%. Those ratios are of the looped layer scan; each case now
runs the default's (`StagePlan.unroll_for`: unrolled on one device without remat, looped
under fsdp or remat), which moved the single-device cases without remat: the update 0.90
-> 1.13, with ptx 0.89 -> 1.12, inference 1.02 -> 1.12 (one layer's activations per model
when unrolled), the prefill 1.09 -> 0.91.
"""

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipe_rlhf_jax.config import MeshSpec, Plan, PPOSettings, StagePlan
from pipe_rlhf_jax.generation import sampler
from pipe_rlhf_jax.models.config import tiny_config
from pipe_rlhf_jax.models.transformer import init_model, with_execution
from pipe_rlhf_jax.optim import make_optimizer
from pipe_rlhf_jax.planner import hardware, memory, space
from pipe_rlhf_jax.ppo.types import Experience, Rollout
from pipe_rlhf_jax.stages.infer import InferSettings, InferStage
from pipe_rlhf_jax.stages.train import PtxBatch, TrainSettings, TrainStage
from pipe_rlhf_jax.system import system


def xla_train_peak(work: space.Workload, plan: StagePlan) -> int:
  """Per-device peak bytes of the real PPO update (TrainStage) compiled for `plan`."""
  rt = Plan(mode="per_stage", train=plan)
  layout = system.build_layouts(rt, jax.devices()[:work.num_devices])["train"]
  agd, actor = nnx.split(init_model(work.actor))
  cgd, critic = nnx.split(init_model(work.critic))
  agd = with_execution(agd, actor, **plan.execution())
  cgd = with_execution(cgd, critic, **plan.execution())
  ppo = PPOSettings(steps=10, batch_size=work.batch_size, minibatch_size=work.minibatch_size,
                  epochs=work.epochs, ptx_coef=1.0 if work.ptx_rows else 0.0,
                  ptx_batch_size=work.ptx_rows)
  opt = make_optimizer(1e-4, total_steps=10, warmup_steps=0, schedule="constant",
                       max_grad_norm=1.0)
  stage = TrainStage(layout, agd, cgd, TrainSettings.from_settings(ppo, 1.0), opt, opt)
  state = stage.init_state(actor, critic)
  b, lp, t = work.batch_size, work.prompt_len, work.gen_len
  z = lambda shape, dtype=jnp.float32: jnp.zeros(shape, dtype)
  rollout = Rollout(prompt_tokens=z((b, lp), jnp.int32), prompt_mask=z((b, lp), bool),
                    completion_tokens=z((b, t), jnp.int32), completion_mask=z((b, t), bool),
                    behaviour_logprobs=z((b, t)), policy_version=z((), jnp.int32))
  exp = Experience(rollout=rollout, old_logprobs=z((b, t)), ref_logprobs=z((b, t)),
                   values=z((b, t)), scores=z((b,)), rewards=z((b, t)),
                   advantages=z((b, t)), returns=z((b, t)), kl=z((b, t)),
                   kl_coef=z(()))
  exp = jax.device_put(exp, layout.batch_shardings(exp))
  ptx = None
  if work.ptx_rows:  # the SFT term's demonstrations, as PPOSystem.ptx_batch places them
    shape = stage.ptx_shape(b)
    ptx = jax.device_put(PtxBatch(
        prompt_tokens=z((*shape, lp), jnp.int32), prompt_mask=z((*shape, lp), bool),
        completion_tokens=z((*shape, t), jnp.int32), completion_mask=z((*shape, t), bool)),
        layout.replicated)
  compiled = stage._build_update(state).lower(state, stage.frozen, exp, jax.random.key(0),
                                              ptx).compile()
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)


def _peak(compiled) -> int:
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)


def _layout(stage: str, plan: StagePlan, n: int):
  rt = Plan(mode="per_stage", **{stage: plan})
  return system.build_layouts(rt, jax.devices()[:n])[stage]


def _rollout(work: space.Workload) -> Rollout:
  b, lp, t = work.batch_size, work.prompt_len, work.gen_len
  z = lambda shape, dtype=jnp.float32: jnp.zeros(shape, dtype)
  return Rollout(prompt_tokens=z((b, lp), jnp.int32), prompt_mask=z((b, lp), bool),
                 completion_tokens=z((b, t), jnp.int32), completion_mask=z((b, t), bool),
                 behaviour_logprobs=z((b, t)), policy_version=z((), jnp.int32))


def xla_infer_peak(work: space.Workload, plan: StagePlan) -> int:
  """Per-device peak bytes of the inference stage's experience program."""
  layout = _layout("infer", plan, work.num_devices)
  models = [nnx.split(init_model(c)) for c in
            (work.actor, work.critic, work.actor.replace(head="score"))]
  (agd, actor), (cgd, critic), (rgd, reward) = [
      (with_execution(gd, st, **plan.execution()), st) for gd, st in models]
  ppo = PPOSettings(steps=10, batch_size=work.batch_size, minibatch_size=work.minibatch_size)
  stage = InferStage(layout, agd, cgd, rgd, InferSettings.from_settings(ppo, 1.0))
  put = lambda state: jax.device_put(state, layout.param_shardings(state))
  rollout = _rollout(work)
  rollout = jax.device_put(rollout, layout.batch_shardings(rollout))
  # The model passes' program (the KL / advantage program after it holds far less).
  return _peak(stage._forward.lower(put(actor), put(critic), put(reward), rollout).compile())


def xla_generate_peak(work: space.Workload, plan: StagePlan) -> int:
  """Per-device peak bytes of the plain sampler's prefill and decode programs."""
  layout = _layout("generate", plan, work.num_devices)
  gd, actor = nnx.split(init_model(work.actor))
  gd = with_execution(gd, actor, **plan.execution())
  actor = jax.device_put(actor, layout.param_shardings(actor))
  params = sampler.SamplingSettings(max_new_tokens=work.gen_len, eos_id=None, pad_id=0)
  b, lp = work.batch_size, work.prompt_len
  tokens = layout.put_batch(np.zeros((b, lp), np.int32))
  mask = layout.put_batch(np.ones((b, lp), bool))
  ids = layout.put_batch(np.arange(b, dtype=np.int32))
  rng = jax.random.key(0)
  with layout.rules_context():
    prefill, decode = sampler.make_generate_fns(gd, params)
    compiled = prefill.lower(actor, tokens, mask, rng, ids).compile()
    state = compiled(actor, tokens, mask, rng, ids)  # the decode program's input
    return max(_peak(compiled), _peak(decode.lower(actor, state, mask, rng, ids).compile()))


PARAMS = tiny_config(vocab_size=8192, embed_dim=256, mlp_dim=768, num_heads=4,
                     num_kv_heads=2, head_dim=64)  # parameter-dominated
ACTS = tiny_config(vocab_size=264, embed_dim=128, mlp_dim=384, num_heads=4,
                   num_kv_heads=2, head_dim=32)  # activation-dominated
# With LoRA adapters: the update trains (and keeps moments of) the adapters only.
PARAMS_LORA = PARAMS.replace(lora_rank=8, lora_targets=("q_proj", "k_proj", "v_proj",
                                                         "o_proj", "gate_proj", "up_proj",
                                                         "down_proj"))
FSDP_TENSOR = MeshSpec(data=1, fsdp=4, tensor=2)
XLA_CASES = [
    # (stage, model, batch, minibatch, mesh, remat[, ptx_rows])
    ("train", PARAMS, 16, 8, FSDP_TENSOR, "none"),
    ("train", PARAMS_LORA, 16, 8, MeshSpec(data=1), "none"),
    ("train", ACTS, 64, 32, MeshSpec(data=1), "none"),
    ("train", ACTS, 64, 32, MeshSpec(data=1), "none", 32),
    ("train", ACTS, 64, 32, MeshSpec(data=1), "full"),
    ("infer", ACTS, 64, 32, MeshSpec(data=1), "none"),
    ("infer", PARAMS, 8, 4, FSDP_TENSOR, "none"),
    ("generate", ACTS, 64, 32, MeshSpec(data=1), "none"),
    ("generate", PARAMS, 8, 4, FSDP_TENSOR, "none"),
    ("generate", PARAMS, 8, 4, MeshSpec(data=1), "none"),  # the decode's weight copies
]
_KIND = {id(PARAMS): "params", id(ACTS): "acts", id(PARAMS_LORA): "params-lora"}
XLA_PEAK = {"train": xla_train_peak, "infer": xla_infer_peak, "generate": xla_generate_peak}


# The default tier checks each (stage, parameters / activations) kind once; the variants of
# a kind (the SFT rows, full remat, the decode's weight copies) run in the slow tier.
SLOW_XLA_CASES = (XLA_CASES[3], XLA_CASES[4], XLA_CASES[9])


@pytest.mark.parametrize("stage,cfg,batch,minibatch,mesh,remat,ptx_rows", [
    pytest.param(*(c + (0,) * (7 - len(c))),
                 id=f"{c[0]}-{_KIND[id(c[1])]}-{c[4]}-{c[5]}"
                 + (f"-ptx{c[6]}" if len(c) > 6 else ""),
                 marks=[pytest.mark.slow] if c in SLOW_XLA_CASES else [])
    for c in XLA_CASES])
def test_memory_model_matches_xla(stage, cfg, batch, minibatch, mesh, remat, ptx_rows):
  n = int(np.prod(list(mesh.as_dict().values())))
  work = space.Workload(actor=cfg, batch_size=batch, minibatch_size=minibatch, epochs=1,
                        prompt_len=16, gen_len=8, num_devices=n, ptx_rows=ptx_rows)
  plan = StagePlan(mesh=mesh, remat=remat)
  predicted = memory.stage_memory(stage, plan, mesh.as_dict(), work).total
  measured = XLA_PEAK[stage](work, plan)
  assert predicted == pytest.approx(measured, rel=0.25)


WORK = space.Workload(actor=tiny_config(), batch_size=64, minibatch_size=32, epochs=2,
                      prompt_len=16, gen_len=8, num_devices=8)


def test_sharding_divides_the_parameter_terms():
  one = memory.stage_memory("train", StagePlan(), dict(data=1, fsdp=1, tensor=1, pipeline=1),
                            dataclasses.replace(WORK, num_devices=1))
  eight = memory.stage_memory("train", StagePlan(mesh=MeshSpec(data=1, fsdp=8)),
                              dict(data=1, fsdp=8, tensor=1, pipeline=1), WORK)
  assert dict(eight.persistent)["adam moments"] == pytest.approx(
      dict(one.persistent)["adam moments"] / 8)
  remat = memory.stage_memory("train", StagePlan(remat="full"),
                              dict(data=1, fsdp=1, tensor=1, pipeline=1), WORK)
  assert dict(remat.transient)["saved activations"] < dict(one.transient)[
      "saved activations"]


def test_time_shared_modes_hold_every_stage_state_at_once():
  rt = Plan(mode="per_stage", generate=StagePlan(mesh=MeshSpec(data=8)),
                     infer=StagePlan(mesh=MeshSpec(data=8)),
                     train=StagePlan(mesh=MeshSpec(data=8)))
  total = memory.plan_memory(rt, WORK)["all"]
  mems = [memory.stage_memory(s, rt.stage(s), rt.stage(s).mesh.as_dict(), WORK)
          for s in ("generate", "infer", "train")]
  assert total == pytest.approx(sum(m.persistent_bytes for m in mems)
                                + max(m.transient_bytes for m in mems))


def test_rejection_names_the_group_and_the_terms():
  small = dataclasses.replace(hardware.get("h100"), hbm_bytes=1e6)
  rt = Plan(mode="pipe", placement=(4, 2, 2),
                     generate=StagePlan(mesh=MeshSpec(data=4)),
                     infer=StagePlan(mesh=MeshSpec(data=2)),
                     train=StagePlan(mesh=MeshSpec(data=1, fsdp=2)))
  reason = memory.memory_error(rt, WORK, small)
  assert "GiB per device on the" in reason and "adam moments" in reason or "params" in reason
  assert memory.memory_error(rt, WORK, hardware.get("h100")) is None
  # Virtual devices share the host's RAM.
  cpu = hardware.get("cpu")
  assert memory.capacity(cpu) == pytest.approx(cpu.hbm_bytes / 8 * memory.USABLE_FRACTION)
  # A job on one of them has the whole host; an accelerator keeps its own memory.
  assert memory.capacity(cpu, 1) == pytest.approx(cpu.hbm_bytes * memory.USABLE_FRACTION)
  h100 = hardware.get("h100")
  assert memory.capacity(h100, 1) == memory.capacity(h100)


def test_critic_free_update_keeps_one_models_state_and_residuals():
  mesh = dict(data=1, fsdp=1, tensor=1, pipeline=1)
  one = dataclasses.replace(WORK, num_devices=1)
  grpo = dataclasses.replace(one, critic_model=False)
  both = dict(memory.stage_memory("train", StagePlan(), mesh, one).transient)
  actor = dict(memory.stage_memory("train", StagePlan(), mesh, grpo).transient)
  assert actor["saved activations"] == pytest.approx(both["saved activations"] / 2)
