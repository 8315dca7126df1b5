"""What a process does in a job (`ProcessRole`), decided from the plan and its layouts.

The 8 virtual CPU devices stand for several processes through `owner` (a device's
process), as in tests/system/test_stage_groups.py.
"""

import pytest

from pipe_rlhf_jax.config import MeshSpec, Plan, StagePlan
from pipe_rlhf_jax.phases.run_state import ProcessRole
from pipe_rlhf_jax.system.system import build_layouts, stage_mesh_shapes
from tests.helpers.configs import tiny_quickstart

QUADS = lambda d: d.id // 4  # 2 processes x 4 devices


def pipe_plan(placement):
  return Plan(mode="pipe", placement=placement,
                       generate=StagePlan(MeshSpec(data=-1)),
                       infer=StagePlan(MeshSpec(data=-1)), train=StagePlan(MeshSpec(data=-1)))


def test_one_process_and_spmd_jobs_train_everywhere_and_process_0_writes():
  layouts = build_layouts(Plan(mode="sequential"))
  alone = ProcessRole.of(Plan(mode="sequential"), layouts, 0, 1, 8)
  assert alone == ProcessRole()
  assert alone.checkpoint_group is None and not alone.trains_alone
  # Sequential mode over 2 processes is one SPMD program: both train, process 0 writes.
  second = ProcessRole.of(Plan(mode="sequential"), layouts, 1, 2, 4, QUADS)
  assert (second.writes, second.trains, second.across) == (False, True, False)
  # Pipe mode in one process is not "across": nothing is placed on processes.
  plan = pipe_plan((4, 2, 2))
  assert not ProcessRole.of(plan, build_layouts(plan), 0, 1, 8).across


def test_pipe_mode_across_processes_trains_in_the_training_stages_processes():
  # 2 processes x 4 devices with process 0's devices last (the order `select_devices`
  # gives pipe mode): training, the last block (devices 4-7), is process 0's.
  plan = pipe_plan((2, 2, 4))
  layouts = build_layouts(plan)
  last_is_0 = lambda d: 1 - d.id // 4
  trainer = ProcessRole.of(plan, layouts, 0, 2, 4, last_is_0)
  other = ProcessRole.of(plan, layouts, 1, 2, 4, last_is_0)
  assert (trainer.writes, trainer.trains, trainer.across) == (True, True, True)
  assert trainer.trainers == (0,) and trainer.trains_alone
  assert trainer.checkpoint_group == [0]
  assert (other.writes, other.trains) == (False, False)
  assert other.checkpoint_group == [1]  # it only reads checkpoints, over its own process
  # 4 processes x 2 devices: training (devices 4-7) spans processes 1 and 0.
  span = lambda d: (2, 3, 1, 0)[d.id // 2]
  role = ProcessRole.of(plan, layouts, 1, 4, 2, span)
  assert role.trainers == (0, 1) and role.trains and not role.trains_alone
  assert role.checkpoint_group == [0, 1]


def test_a_training_stage_outside_process_0_is_refused_naming_the_placement():
  plan = pipe_plan((2, 2, 4))
  with pytest.raises(ValueError, match=(
      r"plan.placement: in pipe mode across processes the training stage must "
      r"include process 0's devices \(the last block of the device order, 4 per "
      r"process\); it lies in processes \[1\]. Make plan.placement.train the last "
      r"block")):
    ProcessRole.of(plan, build_layouts(plan), 0, 2, 4, QUADS)


def test_a_placement_written_for_fewer_devices_keeps_training_on_the_last_ones():
  # The quickstart's tiny placement, 2 + 2 + 4 written for 8 devices, on the 16 of a
  # launch of 2 processes x 8: generation and inference keep the first devices, training
  # takes the last 4 (process 0's in that order) and the 8 between are unused.
  plan = Plan.from_config(tiny_quickstart())
  assert plan.mode == "pipe" and plan.placement == (2, 2, 4)
  blocks = {s: v[2] for s, v in stage_mesh_shapes(plan, 16).items()}
  assert blocks == {"generate": [0, 1], "infer": [2, 3], "train": [12, 13, 14, 15]}
  # On the devices it was written for, nothing moves.
  blocks = {s: v[2] for s, v in stage_mesh_shapes(plan, 8).items()}
  assert blocks == {"generate": [0, 1], "infer": [2, 3], "train": [4, 5, 6, 7]}
  # The same on real layouts, scaled to the 8 test devices: 1 + 1 + 2 written for 4, on
  # 2 processes x 4 with process 0's devices last (`select_devices`): training is
  # process 0's, generation and inference process 1's.
  plan = pipe_plan((1, 1, 2))
  layouts = build_layouts(plan)
  last_is_0 = lambda d: 1 - d.id // 4
  trainer = ProcessRole.of(plan, layouts, 0, 2, 4, last_is_0)
  other = ProcessRole.of(plan, layouts, 1, 2, 4, last_is_0)
  assert trainer.trainers == (0,) and trainer.trains and trainer.writes
  assert not other.trains and not other.writes


def test_a_placement_that_leaves_a_process_without_a_stage_is_refused():
  # 4 processes x 2 devices in `select_devices`'s order (processes 1, 2, 3, then 0):
  # 1 + 1 + 2 holds processes 1 and 0 only.
  plan = pipe_plan((1, 1, 2))
  order = lambda d: (1, 2, 3, 0)[d.id // 2]
  with pytest.raises(ValueError, match=(
      r"plan.placement: in pipe mode across processes every process must hold a "
      r"stage, but the placement 1\+1\+2 leaves processes \[2, 3\] without one \(4 "
      r"processes of 2 devices\). Give the stages more devices \(e.g. "
      r"plan.placement.train a multiple of 2")):
    ProcessRole.of(plan, build_layouts(plan), 0, 4, 2, order)
