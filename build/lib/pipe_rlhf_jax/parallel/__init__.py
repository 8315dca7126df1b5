"""Parallel layer: per-stage meshes, logical axis rules, and cross-mesh resharding.

Importing this package does no device work; meshes are built on demand.
The transfer function is deliberately not re-exported here: `reshard` names the
submodule, so call it as `from pipe_rlhf_jax.parallel.reshard import reshard`.
"""

from pipe_rlhf_jax.parallel.logical import (
    DEFAULT_RULES,
    LOGICAL_AXES,
    STAGE_RULES,
    activation_spec,
    axis_rules,
    check_divisible,
    constrain,
    current_axis_rules,
    logical_sharding,
    logical_to_spec,
    rules_from_config,
    tree_shardings,
)
from pipe_rlhf_jax.parallel.mesh import (
    MESH_AXES,
    MeshShape,
    describe,
    make_mesh,
    split_devices,
)
from pipe_rlhf_jax.parallel.reshard import TransferStats

__all__ = [
    "DEFAULT_RULES", "LOGICAL_AXES", "MESH_AXES", "STAGE_RULES", "MeshShape",
    "TransferStats", "activation_spec", "axis_rules", "check_divisible",
    "constrain", "current_axis_rules", "describe", "logical_sharding",
    "logical_to_spec", "make_mesh", "rules_from_config",
    "split_devices", "tree_shardings",
]
