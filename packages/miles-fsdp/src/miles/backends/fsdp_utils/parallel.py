"""Device meshes of the FSDP backend and the `ParallelState` published from them.

An "axis" is a mesh axis; a "dim" is a tensor dimension. The world is one 3-D mesh
(dp_replicate, dp_shard, cp), outermost axis first, so consecutive ranks share a dp_shard group
(FSDP's all-gathers stay inside a node when dp_shard fits on one):

    dp_replicate: HSDP replicas. Each holds a full copy of the sharded model; gradients are
        all-reduced across replicas after being reduce-scattered inside each one.
    dp_shard:     FSDP sharding. Parameters, gradients and optimizer states are split over it.
    cp:           context parallel: ranks along it hold different tokens of the same sequences
        (accepted here so the mesh is complete; FSDPArgs still rejects cp > 1).
    dp:           dp_replicate x dp_shard flattened: every rank that gets its own samples.
    dp_cp:        dp x cp flattened: all ranks that hold tokens of the batch, where gradients and
        token-weighted metrics are reduced.
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from miles.backends.training_utils.parallel import GroupInfo, ParallelState, set_parallel_state

logger = logging.getLogger(__name__)

MESH_AXES = ("dp_replicate", "dp_shard", "cp")


def build_fsdp_meshes(
    device_type: str,
    world_size: int,
    context_parallel_size: int = 1,
    dp_replicate_size: int = 1,
) -> dict[str, DeviceMesh]:
    """Build the world mesh and return the views the backend uses, keyed by name.

    "fsdp": the mesh for `fully_shard`: 1-D over dp_shard, or 2-D (dp_replicate, dp_shard) for
        HSDP. It leaves cp out: cp ranks hold the same weights, so once the backend supports
        cp > 1 (FSDPArgs rejects it today) it must shard over dp_shard x cp, as torchtitan does,
        or all-reduce gradients over cp itself.
    "dp", "cp", "dp_cp": see the module docstring.

    Every rank must call this with the same arguments: creating a process group is a collective
    over the whole world, and torch matches groups by call order, not by name. That is why every
    axis is built (and flattened) unconditionally, even at size 1, instead of only the axes this
    rank "needs": the sequence of group creations then depends on the sizes alone.
    """
    dp_shard_size = _dp_shard_size(world_size, context_parallel_size, dp_replicate_size)
    sizes = (dp_replicate_size, dp_shard_size, context_parallel_size)
    world = init_device_mesh(device_type, sizes, mesh_dim_names=MESH_AXES)
    # Flattening creates one new group per flattened view, in this fixed order on every rank.
    dp = world["dp_replicate", "dp_shard"]._flatten("dp")
    dp_cp = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    # HSDP only when there is more than one replica: a 2-D mesh with a size-1 replicate axis
    # would work, but costs an extra (no-op) all-reduce per gradient.
    fsdp = world["dp_replicate", "dp_shard"] if dp_replicate_size > 1 else world["dp_shard"]
    logger.info(
        "FSDP mesh: world %d = dp_replicate %d x dp_shard %d x cp %d (fully_shard over %s)",
        world_size,
        dp_replicate_size,
        dp_shard_size,
        context_parallel_size,
        fsdp.mesh_dim_names,
    )
    return {"fsdp": fsdp, "dp": dp, "cp": world["cp"], "dp_cp": dp_cp}


def _dp_shard_size(world_size: int, context_parallel_size: int, dp_replicate_size: int) -> int:
    """world_size / (dp_replicate x cp), after checking that the split is exact."""
    numbers = (
        f"world size {world_size}, --dp-replicate-size {dp_replicate_size}, "
        f"--context-parallel-size {context_parallel_size}"
    )
    if world_size < 1 or context_parallel_size < 1 or dp_replicate_size < 1:
        raise ValueError(f"every mesh size must be >= 1 ({numbers})")
    outer = dp_replicate_size * context_parallel_size
    if world_size % outer:
        raise ValueError(
            f"the world size must be divisible by --dp-replicate-size x --context-parallel-size "
            f"= {outer} ({numbers}); dp_shard is what is left, so choose sizes whose product "
            f"divides {world_size}"
        )
    if dist.is_initialized() and dist.get_world_size() != world_size:
        raise ValueError(
            f"build_fsdp_meshes got world size {world_size}, but torch.distributed has "
            f"{dist.get_world_size()} ranks; pass dist.get_world_size()"
        )
    return world_size // outer


def create_fsdp_parallel_state(meshes: dict[str, DeviceMesh]) -> ParallelState:
    """Publish dp / cp / dp_cp of `meshes` (from `build_fsdp_meshes`) as the parallel state.

    tp, pp and ep stay at size 1: the FSDP backend has none of them.
    """
    missing = {"dp", "cp", "dp_cp"} - meshes.keys()
    if missing:
        raise KeyError(
            f"meshes lack {sorted(missing)}; pass the dict that build_fsdp_meshes returned"
        )
    state = ParallelState(
        dp=_group_info(meshes["dp"]),
        cp=_group_info(meshes["cp"]),
        dp_cp=_group_info(meshes["dp_cp"]),
    )
    set_parallel_state(state)
    return state


def _group_info(mesh: DeviceMesh) -> GroupInfo:
    assert mesh.ndim == 1, f"expected a 1-D mesh view, got axes {mesh.mesh_dim_names}"
    return GroupInfo.from_group(mesh.get_group())
