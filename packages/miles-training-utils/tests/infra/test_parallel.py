"""ParallelState: validation, and construction from real groups."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from miles.backends.training_utils.infra.parallel import (
    GroupInfo,
    ParallelState,
    single_process_parallel_state,
)
from tests.support.distributed import run_distributed


class _StandInGroup:
    """Answers rank() and size() like a ProcessGroup, for size arithmetic without processes."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _axis(size: int, rank: int = 0) -> GroupInfo:
    return GroupInfo.from_group(_StandInGroup(rank, size) if size > 1 else None)


def test_single_process_state_has_every_axis_of_size_one_and_none_enabled():
    state = single_process_parallel_state()
    for name in ("dp", "cp", "tp", "pp", "ep", "dp_cp"):
        axis = getattr(state, name)
        assert (axis.rank, axis.size, axis.group) == (0, 1, None)
        assert getattr(state, f"{name}_enabled") is False
    assert state.world_size == 1


@given(
    dp=st.integers(1, 4),
    cp=st.integers(1, 3),
    tp=st.integers(1, 4),
    pp=st.integers(1, 3),
    data=st.data(),
)
def test_world_size_is_the_product_of_dp_cp_tp_pp_and_enabled_means_size_above_one(
    dp, cp, tp, pp, data
):
    ep = data.draw(st.sampled_from([d for d in range(1, 9) if (dp * cp * tp) % d == 0]))
    sizes = {"dp": dp, "cp": cp, "tp": tp, "pp": pp, "ep": ep, "dp_cp": dp * cp}
    axes = {name: _axis(size, data.draw(st.integers(0, size - 1))) for name, size in sizes.items()}
    state = ParallelState(**axes)
    assert state.world_size == dp * cp * tp * pp
    for name, size in sizes.items():
        assert getattr(state, f"{name}_enabled") is (size > 1)


@pytest.mark.parametrize(
    ("rank", "size", "message"),
    [
        (0, 0, r"GroupInfo\(rank=0, size=0\): size must be >= 1"),
        (2, 2, r"GroupInfo\(rank=2, size=2\): rank must be in \[0, 2\)"),
        (-1, 1, r"GroupInfo\(rank=-1, size=1\): rank must be in \[0, 1\)"),
    ],
)
def test_group_info_rejects_sizes_below_one_and_ranks_outside_the_axis(rank, size, message):
    with pytest.raises(ValueError, match=message):
        GroupInfo(rank=rank, size=size, group=_StandInGroup(rank, size))


def test_group_info_of_several_ranks_without_a_group_is_rejected():
    with pytest.raises(ValueError, match=r"size=4, group=None\): an axis of more than one rank"):
        GroupInfo(rank=1, size=4)


def test_dp_cp_must_be_the_flattened_dp_times_cp_axis_and_the_error_lists_every_size():
    with pytest.raises(ValueError) as error:
        ParallelState(dp=_axis(2), cp=_axis(3), dp_cp=_axis(2))
    assert "dp_cp size (2) must equal dp size (2) x cp size (3) = 6" in str(error.value)
    assert "dp=2, cp=3, tp=1, pp=1, ep=1, dp_cp=2" in str(error.value)


def test_expert_parallel_size_must_divide_dp_cp_tp():
    with pytest.raises(ValueError, match=r"ep size \(4\) must divide dp x cp x tp = 6"):
        ParallelState(dp=_axis(2), tp=_axis(3), ep=_axis(4), dp_cp=_axis(2))
    state = ParallelState(dp=_axis(2), tp=_axis(3), ep=_axis(3), dp_cp=_axis(2))
    assert state.ep_enabled and state.world_size == 6


def test_axes_must_be_group_infos():
    with pytest.raises(TypeError, match=r"ParallelState\.tp must be a GroupInfo, got 2"):
        ParallelState(tp=2)


def _state_from_real_groups(rank: int) -> dict:
    world = dist.group.WORLD
    # new_group is collective: every rank creates every group, then keeps the one it is in.
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    dp_state = ParallelState(
        dp=GroupInfo.from_group(world),
        tp=GroupInfo.from_group(solo),
        dp_cp=GroupInfo(rank=world.rank(), size=world.size(), group=world),
    )
    tp_state = ParallelState(tp=GroupInfo.from_group(world))
    with pytest.raises(ValueError) as too_small:
        single_process_parallel_state()
    with pytest.raises(ValueError) as disagreeing:
        GroupInfo(rank=1 - rank, size=2, group=world)
    return {
        "dp": (dp_state.dp.rank, dp_state.dp.size, dp_state.dp_enabled),
        "tp_of_dp_state": (dp_state.tp.rank, dp_state.tp.size, dp_state.tp_enabled),
        "tp": (tp_state.tp.rank, tp_state.tp_enabled, tp_state.dp_enabled),
        "world_size": dp_state.world_size,
        "too_small": str(too_small.value),
        "disagreeing": str(disagreeing.value),
    }


def test_state_built_from_real_gloo_groups_reads_each_ranks_place_and_checks_the_world():
    results = run_distributed(_state_from_real_groups, 2)
    for rank, result in enumerate(results):
        assert result["dp"] == (rank, 2, True)
        assert result["tp_of_dp_state"] == (0, 1, False)
        assert result["tp"] == (rank, True, False)
        assert result["world_size"] == 2
        assert "dp x cp x tp x pp = 1" in result["too_small"]
        assert "torch.distributed has 2 ranks" in result["too_small"]
        assert (
            f"GroupInfo(rank={1 - rank}, size=2) disagrees with its process group"
            in (result["disagreeing"])
        )
        assert f"(rank {rank}, size 2)" in result["disagreeing"]
