"""Where this rank sits in the training mesh: rank, size and process group per parallel axis.

Both training backends (FSDP, Megatron) build their groups their own way and return them as one
`ParallelState`, which the backend keeps and hands on: backend-neutral code (metric reduction,
data splitting) takes the group or size it needs as an argument. There is deliberately no
process-global state, and this module creates no groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass(kw_only=True, frozen=True)
class GroupInfo:
    """This rank's place along one mesh axis. The default is the single-process axis."""

    rank: int = 0
    """Rank of this process within the axis, in [0, size)."""
    size: int = 1
    """Number of ranks along the axis."""
    group: dist.ProcessGroup | None = None
    """The torch.distributed group of the ranks along this axis; None means single-process
    (size 1), and is never read as torch's default "whole world" group."""

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(
                f"GroupInfo(rank={self.rank}, size={self.size}): size must be >= 1; "
                "an axis this rank does not use has size 1"
            )
        if not 0 <= self.rank < self.size:
            raise ValueError(
                f"GroupInfo(rank={self.rank}, size={self.size}): rank must be in [0, {self.size})"
            )
        if self.group is None:
            if self.size > 1:
                raise ValueError(
                    f"GroupInfo(rank={self.rank}, size={self.size}, group=None): an axis of more "
                    "than one rank needs its process group (None means single-process); pass "
                    "group=<the torch.distributed group of this axis>"
                )
            return
        group_rank, group_size = self.group.rank(), self.group.size()
        if (group_rank, group_size) != (self.rank, self.size):
            raise ValueError(
                f"GroupInfo(rank={self.rank}, size={self.size}) disagrees with its process group "
                f"(rank {group_rank}, size {group_size}); build it with GroupInfo.from_group(group)"
            )

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None) -> GroupInfo:
        """Rank and size read from `group`; None gives the single-process axis."""
        if group is None:
            return cls()
        return cls(rank=group.rank(), size=group.size(), group=group)

    @property
    def enabled(self) -> bool:
        return self.size > 1


@dataclass(kw_only=True, frozen=True)
class ParallelState:
    """The parallel axes of the training mesh, one `GroupInfo` each ("axis" = mesh axis; "dim" is
    kept for tensor dimensions).

    Axes:
        dp: data parallel. Ranks along it train on different samples and hold replicas (or, under
            FSDP, shards) of the same weights.
        cp: context parallel. Ranks along it hold different tokens of the same sequences.
        tp: tensor parallel. Ranks along it hold slices of the same weight matrices and see the
            same tokens.
        pp: pipeline parallel. Ranks along it hold different layers; only the last stage sees
            the loss.
        ep: expert parallel. Ranks along it hold different experts of MoE layers. Megatron carves
            it out of dp x cp x tp, so it is not a factor of the world size; its size must divide
            dp x cp x tp.
        dp_cp: dp and cp flattened into one axis (size dp x cp). Gradients and token-weighted
            metrics are reduced over it, because its ranks together hold every token of the batch
            exactly once.

    The world size is dp x cp x tp x pp; when torch.distributed is initialized it must equal the
    number of ranks there.
    """

    dp: GroupInfo = field(default_factory=GroupInfo)
    cp: GroupInfo = field(default_factory=GroupInfo)
    tp: GroupInfo = field(default_factory=GroupInfo)
    pp: GroupInfo = field(default_factory=GroupInfo)
    ep: GroupInfo = field(default_factory=GroupInfo)
    dp_cp: GroupInfo = field(default_factory=GroupInfo)

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "tp", "pp", "ep", "dp_cp"):
            value = getattr(self, name)
            if not isinstance(value, GroupInfo):
                raise TypeError(f"ParallelState.{name} must be a GroupInfo, got {value!r}")
        sizes = self._sizes_text()
        if self.dp_cp.size != self.dp.size * self.cp.size:
            raise ValueError(
                f"dp_cp size ({self.dp_cp.size}) must equal dp size ({self.dp.size}) x cp size "
                f"({self.cp.size}) = {self.dp.size * self.cp.size} [{sizes}]; dp_cp is the "
                "flattened data x context axis: pass the group spanning both"
            )
        dense = self.dp.size * self.cp.size * self.tp.size
        if dense % self.ep.size:
            raise ValueError(
                f"ep size ({self.ep.size}) must divide dp x cp x tp = {dense} [{sizes}]; expert "
                "parallelism splits those ranks: choose an expert-parallel size dividing it"
            )
        if dist.is_available() and dist.is_initialized():
            ranks = dist.get_world_size()
            if self.world_size != ranks:
                raise ValueError(
                    f"dp x cp x tp x pp = {self.world_size} [{sizes}], but torch.distributed has "
                    f"{ranks} ranks; the mesh must cover every rank exactly once: choose parallel "
                    f"sizes whose product is {ranks}"
                )

    def _sizes_text(self) -> str:
        return ", ".join(
            f"{name}={getattr(self, name).size}" for name in ("dp", "cp", "tp", "pp", "ep", "dp_cp")
        )

    @property
    def world_size(self) -> int:
        """Ranks in the mesh: dp x cp x tp x pp (ep reuses ranks of the other axes)."""
        return self.dp.size * self.cp.size * self.tp.size * self.pp.size

    @property
    def dp_enabled(self) -> bool:
        return self.dp.enabled

    @property
    def cp_enabled(self) -> bool:
        return self.cp.enabled

    @property
    def tp_enabled(self) -> bool:
        return self.tp.enabled

    @property
    def pp_enabled(self) -> bool:
        return self.pp.enabled

    @property
    def ep_enabled(self) -> bool:
        return self.ep.enabled

    @property
    def dp_cp_enabled(self) -> bool:
        return self.dp_cp.enabled


def single_process_parallel_state() -> ParallelState:
    """Every axis of size 1: one process does all the work."""
    return ParallelState()
