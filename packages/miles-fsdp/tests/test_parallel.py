"""FSDP / HSDP device meshes on 4 real gloo ranks, and the ParallelState read from them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from miles.backends.fsdp_utils.parallel import build_fsdp_meshes, create_fsdp_parallel_state

from .distributed import run_distributed

# (dp_replicate, dp_shard, cp) on 4 ranks: pure FSDP, HSDP 2x2, pure replication, and dp x cp.
LAYOUTS = [(1, 4, 1), (2, 2, 1), (4, 1, 1), (1, 2, 2)]


def _describe_meshes(rank: int) -> dict:
    """Every layout, built one after another in the same process group (as a job never does,
    but group creation only has to be identical across ranks, not unique)."""
    described = {}
    for replicate, _, cp in LAYOUTS:
        meshes = build_fsdp_meshes("cpu", 4, context_parallel_size=cp, dp_replicate_size=replicate)
        state = create_fsdp_parallel_state(meshes)
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=state.dp.group)  # the groups are real and usable
        dp_cp = meshes["dp_cp"]
        described[(replicate, cp)] = {
            "meshes": {
                name: (
                    mesh.mesh.tolist(),
                    mesh.mesh_dim_names,
                    [dist.get_process_group_ranks(g) for g in mesh.get_all_groups()],
                )
                for name, mesh in meshes.items()
            },
            "state": {
                axis: (getattr(state, axis).rank, getattr(state, axis).size)
                for axis in ("dp", "cp", "tp", "pp", "ep", "dp_cp")
            },
            "dp_rank_sum": total.item(),
            # The views upstream code takes from the 2-D mesh are the ones returned beside it.
            "dp_cp_views_match": (
                dp_cp["dp"].mesh.tolist() == meshes["dp"].mesh.tolist()
                and dp_cp["cp"].mesh.tolist() == meshes["cp"].mesh.tolist()
            ),
        }
    return described


@pytest.fixture(scope="module")
def described() -> list[dict]:
    return run_distributed(_describe_meshes, 4)


def test_the_views_have_upstream_miles_keys(described):
    for d in described:
        for layout in d.values():
            assert set(layout["meshes"]) == {"dp_cp", "dp", "cp", "fsdp", "dp_cp_flat"}
            assert layout["meshes"]["dp"][1] == ("dp",)
            assert layout["meshes"]["cp"][1] == ("cp",)
            assert layout["meshes"]["dp_cp_flat"][1] == ("dp_cp_flat",)
            assert layout["meshes"]["dp_cp_flat"][2] == [[0, 1, 2, 3]]
            assert layout["dp_cp_views_match"]


def test_dp_cp_is_the_2d_dp_by_cp_mesh(described):
    for rank, d in enumerate(described):
        for (_, cp), layout in d.items():
            mesh, names, (dp_group, cp_group) = layout["meshes"]["dp_cp"]
            assert names == ("dp", "cp")
            # (world / cp, cp), cp innermost: rank = dp_rank x cp + cp_rank.
            assert mesh == [[row * cp + col for col in range(cp)] for row in range(4 // cp)]
            assert dp_group == [rank % cp + cp * i for i in range(4 // cp)]
            assert cp_group == [cp * (rank // cp) + i for i in range(cp)]


def test_pure_fsdp_shards_over_all_four_ranks(described):
    for rank, d in enumerate(described):
        layout = d[(1, 1)]
        assert layout["meshes"]["fsdp"] == ([0, 1, 2, 3], ("dp_shard",), [[0, 1, 2, 3]])
        assert layout["meshes"]["dp"][2] == [[0, 1, 2, 3]]
        assert layout["meshes"]["dp_cp"][:2] == ([[0], [1], [2], [3]], ("dp", "cp"))
        assert layout["meshes"]["cp"][2] == [[rank]]
        assert layout["state"]["dp"] == (rank, 4)
        assert layout["state"]["cp"] == (0, 1)
        assert layout["state"]["dp_cp"] == (rank, 4)
        assert layout["dp_rank_sum"] == 6


def test_hsdp_2x2_shards_inside_pairs_and_replicates_across_them(described):
    for rank, d in enumerate(described):
        layout = d[(2, 1)]
        mesh, names, groups = layout["meshes"]["fsdp"]
        assert (mesh, names) == ([[0, 1], [2, 3]], ("dp_replicate", "dp_shard"))
        replicate_group, shard_group = groups
        assert shard_group == [2 * (rank // 2), 2 * (rank // 2) + 1]  # consecutive ranks shard
        assert replicate_group == [rank % 2, rank % 2 + 2]
        assert layout["meshes"]["dp"][2] == [[0, 1, 2, 3]]
        assert layout["state"]["dp"] == (rank, 4)
        assert layout["state"]["dp_cp"] == (rank, 4)


def test_replicate_4x1_keeps_whole_parameters_on_every_rank(described):
    for rank, d in enumerate(described):
        layout = d[(4, 1)]
        mesh, names, groups = layout["meshes"]["fsdp"]
        assert (mesh, names) == ([[0], [1], [2], [3]], ("dp_replicate", "dp_shard"))
        assert groups == [[0, 1, 2, 3], [rank]]
        assert layout["state"]["dp"] == (rank, 4)


def test_context_parallel_axis_is_innermost_and_dp_cp_spans_the_world(described):
    for rank, d in enumerate(described):
        layout = d[(1, 2)]
        assert layout["meshes"]["dp_cp"][:2] == ([[0, 1], [2, 3]], ("dp", "cp"))
        assert layout["meshes"]["cp"][2] == [[2 * (rank // 2), 2 * (rank // 2) + 1]]
        assert layout["meshes"]["dp"][2] == [[rank % 2, rank % 2 + 2]]
        assert layout["meshes"]["dp_cp_flat"][2] == [[0, 1, 2, 3]]
        assert layout["meshes"]["fsdp"][:2] == ([rank % 2, rank % 2 + 2], ("dp_shard",))
        assert layout["state"]["dp"] == (rank // 2, 2)
        assert layout["state"]["cp"] == (rank % 2, 2)
        assert layout["state"]["dp_cp"] == (rank, 4)
        assert layout["dp_rank_sum"] == (0 + 2 if rank % 2 == 0 else 1 + 3)


def test_model_axes_of_the_fsdp_backend_are_single_rank(described):
    for d in described:
        for layout in d.values():
            assert layout["state"]["tp"] == layout["state"]["pp"] == layout["state"]["ep"] == (0, 1)


@pytest.mark.parametrize(
    ("world", "cp", "replicate", "message"),
    [
        (6, 1, 4, r"divisible by --dp-replicate-size x --context-parallel-size = 4 \(world size 6"),
        (8, 3, 1, r"= 3 \(world size 8, --dp-replicate-size 1, --context-parallel-size 3\)"),
        (4, 1, 0, r"every mesh size must be >= 1 \(world size 4, --dp-replicate-size 0"),
        (0, 1, 1, r"every mesh size must be >= 1 \(world size 0"),
    ],
)
def test_mesh_sizes_that_do_not_divide_the_world_are_rejected_with_every_number(
    world, cp, replicate, message
):
    with pytest.raises(ValueError, match=message):
        build_fsdp_meshes("cpu", world, context_parallel_size=cp, dp_replicate_size=replicate)


def test_create_fsdp_parallel_state_needs_the_meshes_of_build_fsdp_meshes():
    with pytest.raises(KeyError, match=r"keys \['fsdp'\]\) lack \['cp', 'dp', 'dp_cp_flat'\]"):
        create_fsdp_parallel_state({"fsdp": None})
