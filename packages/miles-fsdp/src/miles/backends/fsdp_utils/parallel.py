"""Device meshes of the FSDP backend and the `ParallelState` read from them.

An "axis" is a mesh axis; a "dim" is a tensor dimension. The views and their keys are upstream
miles' (radixark/miles, `fsdp_utils/parallel.py`), so code ported from there indexes them as is.
The root is the 2-D mesh (dp, cp), outermost axis first; dp splits further into
(dp_replicate, dp_shard), so consecutive ranks share a dp_shard group (FSDP's all-gathers stay
inside a node when dp_shard fits on one):

    dp:           every rank that gets its own samples (dp_replicate x dp_shard).
    dp_replicate: HSDP replicas. Each holds a full copy of the sharded model; gradients are
        all-reduced across replicas after being reduce-scattered inside each one.
    dp_shard:     FSDP sharding. Parameters, gradients and optimizer states are split over it.
    cp:           context parallel: ranks along it hold different tokens of the same sequences
        (accepted here so the mesh is complete; FSDPArgs still rejects cp > 1).

The flattened dp x cp axis spans all ranks that hold tokens of the batch, where gradients and
token-weighted metrics are reduced; it is the "dp_cp_flat" view and `ParallelState.dp_cp`.
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from miles.backends.training_utils.infra.parallel import GroupInfo, ParallelState

logger = logging.getLogger(__name__)

DP_CP_AXES = ("dp", "cp")
DP_AXES = ("dp_replicate", "dp_shard")


def build_fsdp_meshes(
    device_type: str,
    world_size: int,
    context_parallel_size: int = 1,
    dp_replicate_size: int = 1,
) -> dict[str, DeviceMesh]:
    """Build the (dp, cp) mesh and return the views the backend uses, keyed by name.

    "dp_cp": the 2-D root mesh, axes ("dp", "cp"), shape (world / cp, cp).
    "dp", "cp": its two axes, `dp_cp["dp"]` and `dp_cp["cp"]`.
    "fsdp": the mesh for `fully_shard`: 1-D over dp_shard, or 2-D (dp_replicate, dp_shard) for
        HSDP. It leaves cp out: cp ranks hold the same weights, so once the backend supports
        cp > 1 (FSDPArgs rejects it today) it must shard over dp_shard x cp, as torchtitan does,
        or all-reduce gradients over cp itself.
    "dp_cp_flat": "dp_cp" flattened to 1-D (every rank of the world): the group that reduces
        gradients and token-weighted metrics over all ranks holding tokens.

    Every rank must call this with the same arguments: creating a process group is a collective
    over the whole world, and torch matches groups by call order, not by name. That is why every
    view is built (and dp split, and dp_cp flattened) unconditionally, even at size 1, instead of
    only the views this rank "needs": the sequence of group creations then depends on the sizes
    alone.
    """
    dp_shard_size = _dp_shard_size(world_size, context_parallel_size, dp_replicate_size)
    dp_size = dp_replicate_size * dp_shard_size
    dp_cp = init_device_mesh(
        device_type, (dp_size, context_parallel_size), mesh_dim_names=DP_CP_AXES
    )
    dp = dp_cp["dp"]
    # Splitting and flattening create new groups, in this fixed order on every rank.
    dp_split = dp._unflatten(0, (dp_replicate_size, dp_shard_size), DP_AXES)
    dp_cp_flat = dp_cp._flatten("dp_cp_flat")
    # HSDP only when there is more than one replica: a 2-D mesh with a size-1 replicate axis
    # would work, but costs an extra (no-op) all-reduce per gradient.
    fsdp = dp_split if dp_replicate_size > 1 else dp_split["dp_shard"]
    logger.info(
        "FSDP mesh: world %d = dp %d (replicate %d x shard %d) x cp %d; fully_shard over %s",
        world_size,
        dp_size,
        dp_replicate_size,
        dp_shard_size,
        context_parallel_size,
        fsdp.mesh_dim_names,
    )
    return {
        "dp_cp": dp_cp,
        "dp": dp,
        "cp": dp_cp["cp"],
        "fsdp": fsdp,
        "dp_cp_flat": dp_cp_flat,
    }


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
    """The dp / cp / dp_cp axes of `meshes` (from `build_fsdp_meshes`) as a `ParallelState`.

    dp_cp is the flattened "dp_cp_flat" view: ParallelState axes are 1-D groups. tp, pp and ep
    stay at size 1: the FSDP backend has none of them. The caller keeps the state; nothing is
    published process-wide.
    """
    missing = {"dp", "cp", "dp_cp_flat"} - meshes.keys()
    if missing:
        raise KeyError(
            f"meshes (keys {sorted(meshes)}) lack {sorted(missing)}; pass the dict that "
            "build_fsdp_meshes returned"
        )
    return ParallelState(
        dp=_group_info(meshes["dp"]),
        cp=_group_info(meshes["cp"]),
        dp_cp=_group_info(meshes["dp_cp_flat"]),
    )


def _group_info(mesh: DeviceMesh) -> GroupInfo:
    assert mesh.ndim == 1, f"expected a 1-D mesh view, got axes {mesh.mesh_dim_names}"
    return GroupInfo.from_group(mesh.get_group())
