"""Tests for cross-mesh resharding (8 CPU devices: two disjoint 4-device meshes)."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from pipe_rlhf_jax.parallel import logical
from pipe_rlhf_jax.parallel import mesh as mesh_lib
from pipe_rlhf_jax.parallel import reshard as reshard_lib
from pipe_rlhf_jax.parallel.logical import DEFAULT_RULES

LOGICAL = {
    "embed": {"embedding": ("vocab", "embed")},
    "layers": {"mlp": {"wi": ("layers", "embed", "mlp"),
                       "wo": ("layers", "mlp", "embed")},
               "norm": ("layers", "embed")},
    "final_norm": ("embed",),
}


def _params():
  rng = np.random.default_rng(0)
  return {
      "embed": {"embedding": rng.standard_normal((16, 8)).astype(np.float32)},
      "layers": {"mlp": {"wi": rng.standard_normal((2, 8, 12)).astype(np.float32),
                         "wo": rng.standard_normal((2, 12, 8)).astype(jnp.bfloat16)},
                 "norm": rng.standard_normal((2, 8)).astype(np.float32)},
      "final_norm": np.arange(8, dtype=np.int32),
  }


@pytest.fixture(scope="module")
def meshes():
  devices = jax.devices()
  groups = mesh_lib.split_devices(devices, {"train": 4, "generate": 4})
  train = mesh_lib.make_mesh(mesh_lib.MeshShape(fsdp=4), groups["train"])
  generate = mesh_lib.make_mesh(mesh_lib.MeshShape(tensor=4), groups["generate"])
  return train, generate


def _device_ids(array):
  return sorted(d.id for d in array.sharding.device_set)


def test_cross_mesh_transfer_is_exact(meshes):
  train, generate = meshes
  host = _params()
  train_sh = logical.tree_shardings(train, LOGICAL, DEFAULT_RULES)
  gen_sh = logical.tree_shardings(generate, LOGICAL, DEFAULT_RULES)
  on_train = jax.device_put(host, train_sh)
  assert _device_ids(on_train["layers"]["mlp"]["wi"]) == [0, 1, 2, 3]
  assert on_train["layers"]["mlp"]["wi"].sharding.spec == P(None, "fsdp", None)

  on_gen, stats = reshard_lib.reshard(on_train, gen_sh)

  for path, leaf in jax.tree_util.tree_leaves_with_path(on_gen):
    assert _device_ids(leaf) == [4, 5, 6, 7], path
  assert on_gen["layers"]["mlp"]["wi"].sharding.spec == P(None, None, "tensor")
  assert on_gen["layers"]["mlp"]["wo"].sharding.spec == P(None, "tensor", None)
  assert on_gen["embed"]["embedding"].sharding.spec == P("tensor", None)
  # Each tensor shard holds a quarter of the mlp dim.
  shard = on_gen["layers"]["mlp"]["wi"].addressable_shards[0]
  assert shard.data.shape == (2, 8, 3)
  for got, want in zip(jax.tree.leaves(on_gen), jax.tree.leaves(host)):
    assert got.dtype == want.dtype
    assert np.array_equal(np.asarray(got), want)

  expected_bytes = sum(x.nbytes for x in jax.tree.leaves(host))
  assert stats.bytes == expected_bytes
  assert stats.num_arrays == 5
  assert stats.seconds > 0.0
  metrics = stats.as_metrics("sync")
  assert metrics["sync/bytes"] == expected_bytes
  assert metrics["sync/num_arrays"] == 5
  assert metrics["sync/bytes_per_second"] > 0

  back, back_stats = reshard_lib.reshard(on_gen, train_sh)
  assert back_stats.bytes == expected_bytes
  for got, want, sh in zip(jax.tree.leaves(back), jax.tree.leaves(host),
                           jax.tree.leaves(train_sh)):
    assert np.array_equal(np.asarray(got), want)
    assert got.sharding.is_equivalent_to(sh, got.ndim)
    assert _device_ids(got) == [0, 1, 2, 3]


def test_single_sharding_and_noop_leaves(meshes):
  train, generate = meshes
  replicated = NamedSharding(generate, P())
  tree = {"a": jnp.arange(8.0), "b": np.ones((2, 3), np.float32)}
  out, stats = reshard_lib.reshard(tree, replicated)
  assert stats.num_arrays == 2 and stats.bytes == 32 + 24
  for leaf in jax.tree.leaves(out):
    assert leaf.sharding.is_equivalent_to(replicated, leaf.ndim)
    assert _device_ids(leaf) == [4, 5, 6, 7]
  # Already in place: passed through, nothing counted.
  again, stats = reshard_lib.reshard(out, replicated)
  assert stats.num_arrays == 0 and stats.bytes == 0
  assert again["a"] is out["a"]
  # Same devices, new layout: counts as a move.
  split = NamedSharding(generate, P("tensor"))
  moved, stats = reshard_lib.reshard({"a": out["a"]}, {"a": split})
  assert stats.num_arrays == 1 and stats.bytes == 32
  assert moved["a"].sharding.spec == P("tensor")
  assert moved["a"].addressable_shards[0].data.shape == (2,)
  np.testing.assert_array_equal(np.asarray(moved["a"]), np.arange(8.0))


def test_donate_still_delivers_values(meshes):
  train, generate = meshes
  x = jax.device_put(jnp.arange(16.0).reshape(4, 4), NamedSharding(train, P("fsdp")))
  y, stats = reshard_lib.reshard(x, NamedSharding(generate, P(None, "tensor")),
                                 donate=True)
  np.testing.assert_array_equal(np.asarray(y), np.arange(16.0).reshape(4, 4))
  assert stats.bytes == 64


def test_bad_targets_raise(meshes):
  _, generate = meshes
  with pytest.raises(TypeError, match="not a jax.sharding.Sharding"):
    reshard_lib.reshard({"a": jnp.ones(2)}, {"a": P()})
  with pytest.raises(ValueError):
    reshard_lib.reshard({"a": jnp.ones(2)}, {"b": NamedSharding(generate, P())})


def test_stats_add():
  total = reshard_lib.TransferStats(10, 0.5, 1) + reshard_lib.TransferStats(6, 0.25, 2)
  assert (total.bytes, total.seconds, total.num_arrays) == (16, 0.75, 3)
  assert reshard_lib.TransferStats().as_metrics("")["bytes_per_second"] == 0.0
