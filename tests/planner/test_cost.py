"""The cost model: the delayed schedule's tick count, rooflines, shared hosts, collectives,
and the closed form as a lower bound of the simulator."""

import dataclasses
import random

import pytest

from pipe_rlhf_jax.config import MeshSpec, Plan, StagePlan
from pipe_rlhf_jax.generation import schedule
from pipe_rlhf_jax.models import flops
from pipe_rlhf_jax.models.config import tiny_config
from pipe_rlhf_jax.planner import (
  composition,
  cost,
  hardware,
  lengths,
  presets,
  simulator,
  space,
  ticks,
)

WORK = space.Workload(actor=tiny_config(), batch_size=64, minibatch_size=32, epochs=1,
                      prompt_len=16, gen_len=8, num_devices=8)
MESH1 = dict(data=1, fsdp=1, tensor=1, pipeline=1)


def test_generation_is_priced_with_the_schedule_tick_count():
  eff = cost.Efficiency(tick_overhead_s=1.0, call_overhead_s=0.0)
  m = cost.Machine(hardware.get("h100"), eff)
  for p, mb in ((1, 1), (2, 2), (4, 1), (4, 8)):
    mesh = dict(data=1, fsdp=1, tensor=1, pipeline=p)
    c = cost.generate_cost(StagePlan(mesh=MeshSpec(data=1, pipeline=p), num_microbatches=mb),
                           mesh, WORK, m)
    assert c.overhead == pytest.approx(schedule.num_ticks(p, mb, WORK.gen_len))


def test_decode_of_a_large_model_is_memory_bound():
  work = dataclasses.replace(WORK, actor=presets.model("llama2-7b"), batch_size=8,
                             prompt_len=128, gen_len=128, num_devices=1)
  # The rooflines alone: the non-matmul term off.
  m = cost.Machine(hardware.get("h100"), cost.Efficiency(
      tick_overhead_s=0, call_overhead_s=0, generate_elementwise=0.0))
  c = cost.generate_cost(StagePlan(), MESH1, work, m)
  # Each step reads every weight and the whole cache of 128 + 128 slots.
  bytes_step = flops.decode_step_bytes(work.actor, 8, 128 + 128)
  expected_decode = bytes_step / (m.hw.hbm_bw * m.eff.decode_bw)
  # The prefill applies the head at the last prompt position only.
  prefill = flops.forward_flops(work.actor, 8, 128, context=256, head_positions=1) / (
      m.hw.peak("bfloat16") * 0.5)
  assert c.compute == pytest.approx(127 * expected_decode + prefill, rel=1e-9)


def test_early_eos_shortens_pipelined_generation_by_the_schedule():
  eff = cost.Efficiency(tick_overhead_s=1.0, call_overhead_s=0.0)
  m = cost.Machine(hardware.get("h100"), eff)
  work = dataclasses.replace(WORK, gen_len=64, batch_size=64)
  plan = StagePlan(mesh=MeshSpec(data=1, pipeline=4), num_microbatches=8)
  mesh = dict(data=1, fsdp=1, tensor=1, pipeline=4)
  full = cost.generate_cost(plan, mesh, work, m)
  short = cost.generate_cost(plan, mesh, dataclasses.replace(work, response_fraction=0.2),
                             m)
  # The tick count is the early-exit schedule's, with the modelled passes per micro-batch.
  passes = lengths.passes_per_microbatch(0.2, 64, 64, 8)
  assert short.overhead == pytest.approx(schedule.early_exit_ticks(4, 8, 64, passes))
  assert full.overhead == pytest.approx(schedule.num_ticks(4, 8, 64))
  # Decode ticks with no busy stage cost nothing but the overhead; with 8 rows per
  # micro-batch each still runs about half of the 64 passes (its longest row).
  assert short.compute < 0.8 * full.compute and short.overhead < 0.9 * full.overhead
  # The plain sampler stops only when the batch's longest row does: at 64 rows and a
  # mean of 20% of 64 tokens, the longest row is still ~3x the mean.
  plain = dataclasses.replace(work, response_fraction=0.2)
  longest = round(lengths.expected_longest(0.2, 64, 64))
  assert cost.generate_cost(StagePlan(), MESH1, plain, m).overhead == longest


def test_shared_host_ticks_share_the_host_between_busy_stages():
  # Four pipeline stages on four virtual devices of a host that runs 2 devices' worth of
  # work at once: a full decode tick costs 4 stages' work at 2 devices' rate.
  eff = cost.Efficiency(tick_overhead_s=0.0, call_overhead_s=0.0, host_concurrency=2.0,
                        device_peak_flops=1e9, hbm_bw=1e15)
  m = cost.Machine(hardware.get("cpu"), eff)
  work = dataclasses.replace(WORK, gen_len=4, batch_size=8)
  plan = StagePlan(mesh=MeshSpec(data=1, pipeline=4), num_microbatches=4)
  c = cost.generate_cost(plan, dict(data=1, fsdp=1, tensor=1, pipeline=4), work, m)
  cfg, slots = work.actor, work.prompt_len + work.gen_len
  dec = flops.forward_flops(cfg, 2, 1, context=slots) / 4 / (1e9 * eff.matmul)
  pre = flops.forward_flops(cfg, 2, work.prompt_len, context=slots,
                            head_positions=1) / 4 / (1e9 * eff.matmul)
  expected = 0.0
  for (a, b), n in ticks.tick_counts(4, 4, 4, 1.0, 8):
    expected += n * (a * pre + b * dec) / min(a + b, 2)
  assert c.compute == pytest.approx(expected)
  # Steady state has all 4 stages decoding: 4 ticks' worth of work at twice one's rate.
  assert dict(ticks.tick_counts(4, 4, 4, 1.0, 8))[(0, 4)] > 0


def test_shared_host_gets_no_speed_up_from_more_devices():
  cpu = cost.Machine(hardware.get("cpu"))
  gpu = cost.Machine(hardware.get("h100"))
  one = dataclasses.replace(WORK, num_devices=1)
  for m, speedup in ((cpu, 1.0), (gpu, 8.0)):
    t1 = cost.train_cost(StagePlan(), MESH1, one, m).compute
    t8 = cost.train_cost(StagePlan(mesh=MeshSpec(data=1, fsdp=8)), dict(MESH1, fsdp=8),
                         WORK, m).compute
    assert t1 / t8 == pytest.approx(speedup, rel=0.05)
  # Data-parallel replicas on a shared host each run the optimizer: slower than one.
  t8 = cost.train_cost(StagePlan(mesh=MeshSpec(data=8)), dict(MESH1, data=8), WORK,
                       cpu).compute
  assert t8 > cost.train_cost(StagePlan(), MESH1, one, cpu).compute


def test_full_remat_adds_a_forward():
  m = cost.Machine(hardware.get("h100"), cost.Efficiency(call_overhead_s=0))
  base = cost.train_cost(StagePlan(), MESH1, WORK, m).compute
  remat = cost.train_cost(StagePlan(remat="full"), MESH1, WORK, m).compute
  assert remat > base * 1.2


def test_alpha_beta_collectives():
  m = cost.Machine(hardware.get("h100"))
  bw, lat = m.hw.intra_bw, m.hw.intra_latency
  assert m.all_gather(1e9, 8) == pytest.approx(lat + 1e9 / bw * 7 / 8)
  assert m.all_reduce(1e9, 8) == pytest.approx(2 * (lat + 1e9 / bw * 7 / 8))
  assert m.all_gather(1e9, 1) == 0.0
  assert m.ppermute(1e6, spans_hosts=True) == pytest.approx(
      m.hw.inter_latency + 1e6 / m.hw.inter_bw)
  # Tensor groups are innermost: inside a host of 8 unless tensor > 8.
  hosts = cost._axis_hosts(dict(data=8, fsdp=1, pipeline=1, tensor=8), m)
  assert hosts == {"tensor": False, "pipeline": False, "fsdp": False, "data": True}


@pytest.mark.parametrize("overrides", [{}, {"qkv_bias": True}, {"tie_embeddings": True},
                                       {"head": "value"}])
def test_weight_collectives_count_the_models_own_arrays(overrides):
  from flax import nnx
  import jax

  from pipe_rlhf_jax.models.transformer import init_model
  cfg = tiny_config(num_layers=3, **overrides)
  _, state = nnx.split(init_model(cfg))
  leaves = jax.tree.leaves(state)
  per_layer, other = cfg.num_param_arrays()
  assert per_layer + other == len(leaves)  # the layers are stacked: one array each
  assert per_layer == sum(1 for x in leaves if x.ndim >= 1 and x.shape[0] == 3)
  cpu, h100 = cost.Machine(hardware.get("cpu")), cost.Machine(hardware.get("h100"))
  # XLA:CPU gathers every layer's arrays one by one; accelerators combine them per layer.
  assert cost.weight_collectives(cfg, 3, cpu) == 3 * per_layer + other
  assert cost.weight_collectives(cfg, 3, h100) == 4


def test_exchanges_count_the_update_s_collectives_and_are_priced_by_the_fit():
  # The planner-accuracy model on 2 cpu devices, batch 32 in minibatches of 16, actor and
  # critic: XLA:CPU's compiled update on fsdp=2 runs 2 x 2 x 2 x (9 x 4 + 3) = 312
  # all-gathers (one per weight array, forward and backward) and the model adds one
  # reduce-scatter per layer and one for the rest (20); on data=2 one all-reduce (two
  # exchanges) per layer and the rest.
  cfg = tiny_config(vocab_size=264, embed_dim=64, num_layers=4, num_heads=4,
                    num_kv_heads=2, head_dim=16, mlp_dim=192)
  work = space.Workload(actor=cfg, batch_size=32, minibatch_size=16, epochs=1,
                        prompt_len=16, gen_len=8, num_devices=8, reward_model=False)
  m = cost.Machine(hardware.get("cpu"), cost.Efficiency(link_latency=2e-5))
  fsdp, data = dict(MESH1, fsdp=2), dict(MESH1, data=2)
  terms = {name: cost.stage_terms("train", StagePlan(mesh=MeshSpec(**mesh)), mesh, work, m)
           for name, mesh in (("fsdp", fsdp), ("data", data), ("one", MESH1))}
  assert terms["fsdp"].exchanges == pytest.approx(312 + 20)
  assert terms["data"].exchanges == pytest.approx(2 * 20)
  assert terms["one"].exchanges == 0.0
  # The fitted seconds per exchange go into the stage's communication, on top of the
  # latency and bandwidth terms.
  fitted = cost.Machine(m.hw, dataclasses.replace(m.eff, train_exchange_s=1e-4))
  base = cost.train_cost(StagePlan(mesh=MeshSpec(**fsdp)), fsdp, work, m)
  more = cost.train_cost(StagePlan(mesh=MeshSpec(**fsdp)), fsdp, work, fitted)
  assert more.comm - base.comm == pytest.approx(1e-4 * 332)
  assert (more.compute, more.overhead) == (base.compute, base.overhead)


def test_a_pipe_axis_outside_generation_repeats_the_work_on_each_pipe_group():
  # Inference and training shard the layers' weights over pipeline, not the batch: each
  # pipeline group runs every layer on its batch shard. Dedicated devices do that side by
  # side; the shared host does all of it.
  work = dataclasses.replace(WORK, num_devices=8)
  split, layered = dict(data=4, fsdp=1, tensor=1, pipeline=1), dict(data=4, fsdp=1, tensor=1,
                                                                 pipeline=2)
  cpu = cost.Machine(hardware.get("cpu"), cost.Efficiency(host_concurrency=1.0))
  h100 = cost.Machine(hardware.get("h100"))
  for stage in ("infer", "train"):
    plan = StagePlan()
    on = lambda m, mesh: cost.STAGE_TERMS[stage](plan, mesh, work, m).roofline
    assert on(cpu, layered) == pytest.approx(2 * on(cpu, split))
    assert on(h100, layered) == pytest.approx(on(h100, split))


def test_sequential_syncs_nothing_and_pipe_moves_weights():
  m = cost.Machine(hardware.get("h100"))
  seq = Plan(mode="sequential")
  pipe = Plan(mode="pipe", placement=(4, 2, 2),
                       generate=StagePlan(mesh=MeshSpec(data=4)),
                       infer=StagePlan(mesh=MeshSpec(data=2)),
                       train=StagePlan(mesh=MeshSpec(data=1, fsdp=2)))
  assert composition.plan_cost(seq, WORK, m).sync == 0.0
  assert composition.plan_cost(pipe, WORK, m).sync > 0.0


def test_closed_form_is_a_lower_bound_of_the_simulator():
  rng = random.Random(0)
  for _ in range(40):
    times = {s: rng.uniform(0.1, 2.0) for s in ("generate", "infer", "train")}
    sync = rng.uniform(0.0, 0.5)
    s = rng.choice([0, 1, 2])
    q = rng.choice([1, 2])
    rt = Plan(mode="pipe", placement=(1, 1, 1), max_staleness=s, queue_size=q)
    bound = composition.closed_form(times, sync, rt)
    sim = simulator.simulate(times, sync, "pipe", max_staleness=s, queue_size=q, steps=40)
    assert sim.step_time >= bound * (1 - 1e-6)
    if q == 2:
      assert sim.step_time == pytest.approx(bound, rel=0.05)


def test_critic_free_and_reference_free_workloads_price_only_their_models():
  m = cost.Machine(hardware.get("h100"), cost.Efficiency(call_overhead_s=0.0))
  grpo = dataclasses.replace(WORK, critic_model=False, reference_model=False,
                             reward_model=False)
  assert [c.head for c in grpo.models("train")] == ["lm"]
  assert grpo.models("infer") == []
  full = cost.train_cost(StagePlan(), MESH1, WORK, m)
  actor_only = cost.train_cost(StagePlan(), MESH1, grpo, m)
  # Actor and critic share the backbone: the critic-free update does about half the work.
  assert actor_only.compute == pytest.approx(full.compute / 2, rel=0.1)
  pipe = Plan(mode="pipe", placement=(4, 2, 2),
                       generate=StagePlan(mesh=MeshSpec(data=4)),
                       infer=StagePlan(mesh=MeshSpec(data=2)),
                       train=StagePlan(mesh=MeshSpec(data=1, fsdp=2)))
  assert composition.plan_cost(pipe, grpo, m).sync < composition.plan_cost(pipe, WORK, m).sync
  assert space.plan_error(pipe, grpo) is None


def test_the_updates_proximal_pass_is_priced_as_one_actor_forward():
  # The decoupled loss, the rewards' KL at the trainer's policy and the early stop start
  # the update with the actor's forward over the batch: as inference prices the reference.
  m = cost.Machine(hardware.get("h100"), cost.Efficiency(call_overhead_s=0.0))
  with_pass = dataclasses.replace(WORK, proximal_pass=True)
  extra = (cost.train_terms(StagePlan(), MESH1, with_pass, m).roofline
           - cost.train_terms(StagePlan(), MESH1, WORK, m).roofline)
  reference_only = dataclasses.replace(WORK, critic_model=False, reward_model=False)
  assert extra == pytest.approx(
      cost.infer_terms(StagePlan(), MESH1, reference_only, m).roofline, rel=1e-9)
  assert extra > 0


def test_the_sft_term_is_priced_as_more_rows_of_the_actors_training():
  # PPO-ptx: each gradient step also trains the actor on ptx_rows demonstrations, as
  # much work as a critic-free update of a minibatch that many rows larger.
  m = cost.Machine(hardware.get("h100"), cost.Efficiency(call_overhead_s=0.0))
  actor_only = dataclasses.replace(WORK, critic_model=False)
  ptx = dataclasses.replace(actor_only, ptx_rows=WORK.minibatch_size)
  larger = dataclasses.replace(actor_only, minibatch_size=2 * WORK.minibatch_size,
                               batch_size=2 * WORK.batch_size)
  terms = lambda work: cost.train_terms(StagePlan(), MESH1, work, m).roofline
  assert terms(ptx) == pytest.approx(terms(larger), rel=1e-9)
  assert terms(ptx) > terms(actor_only)
  import configs.quickstart as quickstart
  from pipe_rlhf_jax.config import ExperimentSettings
  from pipe_rlhf_jax.planner import auto
  config = quickstart.get_config()
  work = lambda: auto.workload(ExperimentSettings.from_config(config), tiny_config(), 8, 8)
  config.ppo.ptx_coef = 0.0
  assert work().ptx_rows == 0
  config.ppo.ptx_coef = 0.5
  assert work().ptx_rows == config.ppo.minibatch_size
  config.ppo.ptx_batch_size = 8
  assert work().ptx_rows == 8


def test_the_workload_knows_when_the_update_runs_a_proximal_pass():
  import configs.quickstart as quickstart
  from pipe_rlhf_jax.config import ExperimentSettings
  from pipe_rlhf_jax.planner import auto
  config = quickstart.get_config()
  work = lambda: auto.workload(ExperimentSettings.from_config(config), tiny_config(), 8, 8)
  assert work().proximal_pass  # kl_policy=proximal
  config.ppo.update(kl_policy="behaviour", target_kl=0.0)
  assert not work().proximal_pass
  config.ppo.loss = "decoupled_ppo_clip"
  assert work().proximal_pass


def test_shared_host_demand_counts_overheads_as_one_device_of_work():
  # Host of 2 devices' worth (C = 2): a stage on 4 devices whose time is all compute
  # uses the whole host; one whose time is all overhead (serial host work) half of it.
  m = cost.Machine(hardware.get("cpu"), cost.Efficiency(host_concurrency=2.0,
                                                        device_peak_flops=1e9))
  rt = Plan(mode="pipe", placement=(4, 2, 2))
  shapes = {"generate": dict(data=4, fsdp=1, tensor=1, pipeline=1),
            "infer": dict(data=2, fsdp=1, tensor=1, pipeline=1),
            "train": dict(data=2, fsdp=1, tensor=1, pipeline=1)}
  costs = {"generate": cost.StageCost(1.0, 0.0, 0.0), "infer": cost.StageCost(0.0, 0.0, 1.0),
           "train": cost.StageCost(0.5, 0.0, 0.5)}
  d = composition.stage_demands(rt, shapes, m, "float32", costs)
  assert d["generate"] == pytest.approx(1.0)
  assert d["infer"] == pytest.approx(0.5)
  assert d["train"] == pytest.approx(0.75)
  # Without the breakdown: the devices' compute rate alone (the upper bound).
  assert composition.stage_demands(rt, shapes, m, "float32")["infer"] == pytest.approx(1.0)


def test_multi_device_pipe_stages_are_exclusive_on_the_cpu_backend():
  # jax's CPU backend runs programs over several devices one at a time
  # (experiments/bench_cpu_concurrency.py): there, pipe stages on more than one device
  # cannot overlap, and the closed form's bound includes their sum.
  rt = Plan(mode="pipe", max_staleness=2, placement=(1, 3, 4),
                     generate=StagePlan(MeshSpec(data=1)), infer=StagePlan(MeshSpec(data=3)),
                     train=StagePlan(MeshSpec(fsdp=4)))
  shapes = {"generate": {"data": 1, "fsdp": 1, "tensor": 1, "pipeline": 1},
            "infer": {"data": 3, "fsdp": 1, "tensor": 1, "pipeline": 1},
            "train": {"data": 1, "fsdp": 4, "tensor": 1, "pipeline": 1}}
  cpu = cost.Machine(hardware.get("cpu"))
  assert composition.exclusive_stages(rt, shapes, cpu) == {"infer", "train"}
  assert composition.exclusive_stages(rt, shapes, cost.Machine(hardware.get("h100"))) == set()
  serial = dataclasses.replace(rt, mode="sequential", placement=None)
  assert composition.exclusive_stages(serial, shapes, cpu) == set()
  times = {"generate": 1.0, "infer": 1.0, "train": 2.0}
  assert composition.closed_form(times, 0.0, rt) == pytest.approx(2.0)
  assert composition.closed_form(times, 0.0, rt, exclusive={"infer", "train"}) == pytest.approx(3.0)


def _long_tail(count=256, median=24, cap=256, seed=0):
  rs = random.Random(seed)
  return tuple(min(cap, max(1, round(median * rs.lognormvariate(0.0, 0.894))))
               for _ in range(count))


def test_continuous_batching_is_priced_with_the_engines_schedule():
  eff = cost.Efficiency(tick_overhead_s=1.0, call_overhead_s=0.0)
  m = cost.Machine(hardware.get("h100"), eff)
  work = dataclasses.replace(WORK, batch_size=64, gen_len=256, num_devices=1,
                             response_lengths=_long_tail())
  static = cost.generate_cost(StagePlan(), MESH1, work, m)
  engine_plan = StagePlan(num_slots=16)
  continuous = cost.generate_cost(engine_plan, MESH1, work, m)
  timeline = ticks.engine_timeline(work.batch_lengths(), 16, 1)
  # One tick per decode step and per admission, each priced at the engine's own rows.
  assert continuous.overhead == pytest.approx(timeline.decode_steps
                                              + len(timeline.prefill_widths))
  assert static.overhead == pytest.approx(max(work.batch_lengths()))  # 1 prefill + T - 1
  # Where a step's cost grows with its rows (a compute-bound CPU), 16 slots decode a long
  # tail in less compute than one static batch of 64 rows waiting on its longest row.
  cpu = cost.Machine(hardware.get("cpu"), cost.Efficiency(tick_overhead_s=0.0,
                                                          call_overhead_s=0.0))
  assert (cost.generate_cost(engine_plan, MESH1, work, cpu).compute
          < 0.8 * cost.generate_cost(StagePlan(), MESH1, work, cpu).compute)
  # Every row the same length: nothing to gain from refilling slots.
  uniform = dataclasses.replace(work, response_lengths=(64,) * 8)
  assert (cost.generate_cost(engine_plan, MESH1, uniform, cpu).compute
          >= 0.95 * cost.generate_cost(StagePlan(), MESH1, uniform, cpu).compute)


def test_chunked_prefill_is_priced_as_its_passes_and_the_steps_between():
  eff = cost.Efficiency(tick_overhead_s=1.0, call_overhead_s=0.0)
  m = cost.Machine(hardware.get("h100"), eff)
  work = dataclasses.replace(WORK, batch_size=64, gen_len=256, num_devices=1,
                             response_lengths=_long_tail())
  whole = cost.generate_cost(StagePlan(num_slots=16), MESH1, work, m)
  passes = -(-work.prompt_len // 8)
  chunked = cost.generate_cost(StagePlan(num_slots=16, prefill_chunk=8), MESH1, work, m)
  timeline = ticks.engine_timeline(work.batch_lengths(), 16, 1, 8, work.prompt_len)
  # A tick per decode step (those between passes included) and per prefill pass.
  assert timeline.decode_steps > ticks.engine_timeline(work.batch_lengths(), 16, 1).decode_steps
  assert chunked.overhead == pytest.approx(timeline.decode_steps
                                           + passes * len(timeline.prefill_widths))
  # The passes do the prompt's work once (P a multiple of the chunk here): the roofline
  # changes only by the extra decode steps, each at most one step's cost.
  extra = timeline.decode_steps - ticks.engine_timeline(work.batch_lengths(), 16, 1).decode_steps
  one_step = whole.compute / max(whole.overhead, 1)
  assert whole.compute <= chunked.compute <= whole.compute + (extra + passes * 16) * one_step


def test_batch_lengths_follow_the_distribution_given():
  assert set(lengths.batch_lengths(1.0, 32, 16)) == {32}
  modelled = lengths.batch_lengths(0.25, 64, 4096)
  assert abs(sum(modelled) / len(modelled) - 16) < 1.0  # the hazard model's mean
  observed = lengths.batch_lengths(1.0, 512, 8, (10, 20, 30, 40))
  assert sorted(observed) == [10, 10, 20, 20, 30, 30, 40, 40]
