"""Stage groups spanning processes, in one process: the blocks a receiving process pulls
and the placement check of `pipe` mode across processes.

The 8 virtual CPU devices of one process stand for several processes through the
`owner` argument (a device's process), so the block arithmetic and the placement errors
are tested without starting any; the transfers themselves are tested across real
processes in tests/distributed/test_multihost.py.
"""

import dataclasses

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from pipe_rlhf_jax.config import MeshSpec, Plan, StagePlan
from pipe_rlhf_jax.distributed import transfer as tr
from pipe_rlhf_jax.parallel.mesh import MeshShape, make_mesh
from pipe_rlhf_jax.system.pipe_processes import stage_processes
from pipe_rlhf_jax.system.system import build_layouts

PAIRS = lambda d: d.id // 2  # 4 processes x 2 devices
QUADS = lambda d: d.id // 4  # 2 processes x 4 devices


def assemble(sharding, x, owner, processes):
  """The global array rebuilt from each process's block, as a receiving stage does: the
  block laid out on its sub-mesh, then every device's shard taken from it."""
  shards = []
  for p in processes:
    block = tr.block_of(sharding, x.shape, p, owner)
    shards += [s.data for s in jax.device_put(x[block.index], block.sharding)
               .addressable_shards]
  return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)


@pytest.mark.parametrize("shape, axes, spec, owner", [
    ((8, 6), MeshShape(pipeline=4, tensor=2), P("pipeline", "tensor"), PAIRS),  # layer blocks
    ((16, 3), MeshShape(data=2, fsdp=4), P(("data", "fsdp")), QUADS),  # batch rows
    ((8, 4), MeshShape(data=4, tensor=2), P("data", "tensor"), lambda d: d.id % 2),
    ((8, 6), MeshShape(pipeline=4, tensor=2), P(None, "tensor"), PAIRS),  # replicated rows
    ((), MeshShape(pipeline=4, tensor=2), P(), PAIRS),  # a scalar
])
def test_each_process_block_reassembles_the_global_array(shape, axes, spec, owner):
  sharding = NamedSharding(make_mesh(axes), spec)
  x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
  processes = sorted({owner(d) for d in jax.devices()})
  got = assemble(sharding, x, owner, processes)
  np.testing.assert_array_equal(np.asarray(got), x)
  for d, index in sharding.devices_indices_map(shape).items():
    np.testing.assert_array_equal(np.asarray(got.addressable_data(
        [s.device for s in got.addressable_shards].index(d))), x[index])


def test_the_block_of_a_process_has_its_shape_and_its_place_in_the_array():
  mesh = make_mesh(MeshShape(pipeline=4, tensor=2))
  block = tr.block_of(NamedSharding(mesh, P("pipeline", "tensor")), (8, 6), 2, PAIRS)
  assert (block.start, block.shape) == ((4, 0), (2, 6))
  assert dict(block.sharding.mesh.shape) == {"data": 1, "fsdp": 1, "pipeline": 1, "tensor": 2}
  assert [d.id for d in block.sharding.mesh.devices.flat] == [4, 5]
  assert block.sharding.spec == P("pipeline", "tensor")
  # Rows replicated along the processes' axis: every process holds the whole array.
  whole = tr.block_of(NamedSharding(mesh, P(None, "tensor")), (8, 6), 3, PAIRS)
  assert (whole.start, whole.shape) == ((0, 0), (8, 6))
  # A mesh within one process: the whole array on the mesh itself.
  sharding = NamedSharding(mesh, P("pipeline"))
  assert tr.block_of(sharding, (8, 6), 0, lambda d: 0).sharding == sharding


def test_a_process_whose_devices_are_not_a_block_is_refused():
  mesh = make_mesh(MeshShape(pipeline=4, tensor=2))  # rows [0 1] [2 3] [4 5] [6 7]
  # Process 0 on devices 0 and 3: a diagonal of the mesh, no rectangle.
  diagonal = {0: 0, 3: 0, 1: 1, 2: 1, 4: 2, 5: 2, 6: 3, 7: 3}
  with pytest.raises(ValueError, match=r"plan.placement: process 0's devices in the "
                     r"mesh .* are not a rectangular block"):
    tr.block_of(NamedSharding(mesh, P("pipeline")), (8, 6), 0, lambda d: diagonal[d.id])
  # Devices 0 and 4 (rows 0 and 2 of the mesh) are a rectangle, but their rows of a
  # pipeline-sharded array are not one block.
  with pytest.raises(ValueError, match=r"is not one block per process"):
    tr.block_of(NamedSharding(mesh, P("pipeline")), (8, 6), 0, lambda d: d.id % 4)


def pipe_plan(placement, generate=MeshSpec(data=-1)):
  return Plan(mode="pipe", placement=placement, generate=StagePlan(generate),
                       infer=StagePlan(MeshSpec(data=-1)), train=StagePlan(MeshSpec(data=-1)))


def test_stage_groups_of_whole_processes():
  # 4 processes x 2 devices: generation spans processes 0-1 (its pipeline rows), inference
  # and training one process each.
  layouts = build_layouts(pipe_plan((4, 2, 2), MeshSpec(data=1, pipeline=2, tensor=2)))
  assert stage_processes(layouts, PAIRS) == {"generate": (0, 1), "infer": (2,),
                                             "train": (3,)}
  # Single-process stages as before: two of them may share a process.
  assert stage_processes(layouts, QUADS) == {"generate": (0,), "infer": (1,),
                                             "train": (1,)}


def test_a_multi_process_stage_sharing_a_process_is_refused():
  # Generation on devices 0-2 (processes 0 and 1), inference on 3-5 (processes 1, 2).
  layouts = build_layouts(pipe_plan((3, 3, 2)))
  with pytest.raises(ValueError, match=(
      r"plan.placement: .* a stage spanning several processes must have them to "
      r"itself, but the generate stage .* spans processes \[0, 1\] and process 1 also "
      r"holds the infer stage: .* could deadlock. Cut plan.placement at process "
      r"boundaries")):
    stage_processes(layouts, PAIRS)


def test_a_multi_process_stage_whose_processes_are_not_blocks_is_refused():
  # Generation data=2 x tensor=2 on devices 0-3, cut into processes of one device from
  # each data row: process 0 holds devices 0 and 2, a column, but devices 0 and 3 would
  # not be a rectangle.
  layouts = build_layouts(pipe_plan((4, 2, 2), MeshSpec(data=2, tensor=2)))
  odd = {0: 0, 3: 0, 1: 1, 2: 1, 4: 2, 5: 2, 6: 3, 7: 3}
  with pytest.raises(ValueError, match=r"plan.placement: process 0's devices in the "
                     r"mesh .* are not a rectangular block"):
    stage_processes(layouts, lambda d: odd[d.id])


def test_a_block_sent_for_another_place_in_the_array_is_refused():
  sharding = NamedSharding(make_mesh(MeshShape(pipeline=4, tensor=2)), P("pipeline", "tensor"))
  mine = tr.block_of(sharding, (8, 6), 1, PAIRS)
  theirs = tr.block_of(sharding, (8, 6), 2, PAIRS)  # same shape and sub-mesh, rows 4-5
  layout = lambda b: [dataclasses.replace(x, start=b.start) for x in tr.layout_of(
      {"w": jax.ShapeDtypeStruct(b.shape, np.float32, sharding=b.sharding)})]
  with pytest.raises(tr.LayoutMismatch, match=r"leaf \['w'\] is sent as float32\[2, 6\] "
                     r"at \[4, 0\] .* but the receiver expects float32\[2, 6\] at \[2, 0\]"
                     r".*nothing was moved"):
    tr.check_same_layout(layout(theirs), layout(mine), "test")
