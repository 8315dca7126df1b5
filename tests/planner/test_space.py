"""The plan space: only valid plans, exactly the system's validity, overrides round trip."""

import dataclasses
import itertools

from flax import nnx
import jax
import pytest

from configs import quickstart
from pipe_rlhf_jax.config import STAGES, MeshSpec, Plan, StagePlan
from pipe_rlhf_jax.models.config import tiny_config
from pipe_rlhf_jax.models.transformer import init_model
from pipe_rlhf_jax.planner import space
from pipe_rlhf_jax.system import system

# 2 layers, 2 heads, 1 kv head: tensor > 1 never fits, pipeline only 1 or 2.
SMALL = space.Workload(actor=tiny_config(embed_dim=32, num_layers=2, num_heads=2,
                                         num_kv_heads=1, head_dim=16, mlp_dim=64),
                       batch_size=8, minibatch_size=4, epochs=1, prompt_len=8, gen_len=4,
                       num_devices=4)
OPTIONS = space.SpaceOptions(staleness=(0, 1), train_remat=("none",))


def _all_candidates(work, options):
  """Every Plan the space's levels could name, valid or not (brute force)."""
  n = work.num_devices
  for sch in space.schedules(options):
    common = dict(mode=sch.mode, max_staleness=sch.max_staleness, queue_size=sch.queue_size)
    if sch.mode == "sequential":
      for mesh in space.mesh_shapes(n):
        yield Plan(mesh=mesh, **common)
      continue
    counts_list = [(n, n, n)] if sch.mode == "per_stage" else [
        c for c in itertools.product(range(1, n + 1), repeat=3) if sum(c) == n]
    for counts in counts_list:
      per_stage = []
      for s, c in zip(STAGES, counts):
        plans = []
        for mesh in space.mesh_shapes(c):
          if s == "train" and mesh.pipeline > 1:
            continue  # Plan itself refuses it
          for m in ((1, 2, 4, 8) if s == "generate" else (1,)):
            plans.append(StagePlan(mesh=mesh, num_microbatches=m))
        per_stage.append(plans)
      for g, i, t in itertools.product(*per_stage):
        yield Plan(placement=counts if sch.mode == "pipe" else None, generate=g,
                            infer=i, train=t, **common)


def _key(rt):
  # M only matters with a pipelined generator (the system ignores it otherwise).
  gen = rt.generate
  if rt.mode == "sequential" or gen.mesh.pipeline == 1:
    gen = dataclasses.replace(gen, num_microbatches=1)
  return dataclasses.replace(rt, generate=gen)


def test_enumeration_is_exactly_the_valid_plans():
  enumerated = list(space.enumerate_plans(SMALL, OPTIONS))
  assert len(enumerated) == len(set(enumerated))
  for rt in enumerated:
    assert space.plan_error(rt, SMALL) is None, rt
  valid = {_key(rt) for rt in _all_candidates(SMALL, OPTIONS)
           if space.plan_error(rt, SMALL) is None}
  assert {_key(rt) for rt in enumerated} == valid
  modes = {rt.mode for rt in enumerated}
  assert modes == {"sequential", "per_stage", "pipe"}
  # The model's divisibility rules hold: no tensor split of 1 kv head, pipe <= 2 layers.
  assert all(rt.stage(s).mesh.tensor == 1 for rt in enumerated for s in STAGES)
  assert max(rt.generate.mesh.pipeline for rt in enumerated) == 2


def test_validity_agrees_with_the_plan_on_real_devices():
  """The planner's verdict equals build_layouts + check_fits + check_batch_fits on the
  8 virtual devices, for valid and invalid plans alike."""
  work = dataclasses.replace(SMALL, num_devices=8)
  devices = jax.devices()[:8]
  actor = nnx.state(nnx.eval_shape(lambda: init_model(work.actor)))
  critic = nnx.state(nnx.eval_shape(lambda: init_model(work.critic)))
  plans = [
      Plan(mode="pipe", placement=(2, 2, 4),
                    generate=StagePlan(mesh=MeshSpec(data=1, pipeline=2), num_microbatches=2),
                    infer=StagePlan(mesh=MeshSpec(data=2)),
                    train=StagePlan(mesh=MeshSpec(data=1, fsdp=4))),
      Plan(mode="per_stage", generate=StagePlan(mesh=MeshSpec(data=8)),
                    infer=StagePlan(mesh=MeshSpec(data=4, pipeline=2)),
                    train=StagePlan(mesh=MeshSpec(fsdp=8))),
      # invalid: tensor=2 over 1 kv head
      Plan(mode="per_stage", generate=StagePlan(mesh=MeshSpec(data=4, tensor=2)),
                    infer=StagePlan(mesh=MeshSpec(data=8)),
                    train=StagePlan(mesh=MeshSpec(fsdp=8))),
      # invalid: a pipelined generator may only add tensor to pipeline, not data
      Plan(mode="per_stage", generate=StagePlan(mesh=MeshSpec(data=4, pipeline=2)),
                    infer=StagePlan(mesh=MeshSpec(data=8)),
                    train=StagePlan(mesh=MeshSpec(fsdp=8))),
  ]
  verdicts = []
  for rt in plans:
    try:
      layouts = system.build_layouts(rt, devices)
      system.check_fits(layouts, actor, critic)
      system.check_batch_fits(layouts, work.batch_size, rt)
      runtime_error = None
    except ValueError as e:
      runtime_error = str(e)
    planner_error = space.plan_error(rt, work)
    assert (runtime_error is None) == (planner_error is None), (rt, runtime_error,
                                                                planner_error)
    verdicts.append(planner_error is None)
    if runtime_error is not None:
      # Same check, same field named.
      assert runtime_error.split(":")[0] == planner_error.split(":")[0]
  assert verdicts == [True, True, False, False]


def test_stage_error_names_the_field_and_the_fix():
  err = space.stage_error("generate", StagePlan(mesh=MeshSpec(data=1, tensor=2)), 2, SMALL)
  assert err.startswith("stages.generate.mesh") and "kv_heads=1" in err
  err = space.stage_error("generate", StagePlan(mesh=MeshSpec(data=1, pipeline=2),
                                                num_microbatches=3), 2, SMALL)
  assert "num_microbatches" in err


def test_placements_are_host_aligned():
  assert (1, 1, 2) in space.placements(4)
  assert len(space.placements(4)) == 3
  # Four hosts of 8: whole hosts at host boundaries, or blocks inside one host.
  four_hosts = space.placements(32, devices_per_host=8)
  for counts in four_hosts:
    starts = (0, counts[0], counts[0] + counts[1])
    assert sum(counts) == 32
    for start, size in zip(starts, counts):
      assert (size % 8 == 0 and start % 8 == 0) or start // 8 == (start + size - 1) // 8
  assert {(8, 8, 16), (16, 8, 8), (4, 4, 24), (8, 2, 22)} - set(four_hosts) == {(8, 2, 22)}
  assert (24, 4, 4) in four_hosts and (4, 8, 20) not in four_hosts
  # Two hosts: pipe mode needs a host shared by two stages.
  assert set(space.placements(16, devices_per_host=8)) == {
      (8, i, 8 - i) for i in range(1, 8)} | {(g, 8 - g, 8) for g in range(1, 8)}
  coarse = space.placements(1024, devices_per_host=4, coarse=True)
  assert (512, 256, 256) in coarse and all(sum(c) == 1024 for c in coarse)
  with pytest.raises(ValueError, match="whole number of hosts"):
    space.placements(12, devices_per_host=8)


def test_overrides_round_trip_through_a_locked_experiment_config():
  work = dataclasses.replace(SMALL, num_devices=8)
  config = quickstart.get_config()
  plans = list(space.enumerate_plans(work, OPTIONS))
  sample = [p for p in plans if p.mode == "sequential"][:2] + \
           [p for p in plans if p.mode == "per_stage"][:3] + \
           [p for p in plans if p.mode == "pipe"][::97]
  for plan in sample:
    overrides = space.to_overrides(plan, config)
    locked = quickstart.get_config()
    locked.lock()
    for key, value in overrides.items():  # as --config.KEY=VALUE would, on a locked config
      node, parts = locked, key.split(".")
      for part in parts[:-1]:
        node = node[part]
      setattr(node, parts[-1], value)
    back = Plan.from_config(locked)
    if plan.mode != "pipe":
      back = dataclasses.replace(back, placement=None)  # ignored outside pipe
    assert back == plan
    assert space.from_overrides(space.to_overrides(plan)) == plan
    flags = space.override_flags(plan, config)
    assert flags[0] == f"--config.plan.mode={plan.mode}"
