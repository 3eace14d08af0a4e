"""Group-relative baselines: GRPO's normalized rewards and RLOO's leave-one-out advantages.

A group is `group_size` consecutive samples drawn for one prompt; every sample's reward is compared
with the others of its group. Pure functions over (B,) rewards.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["group_normalize_rewards", "rloo_advantages"]


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    if group_size < 1:
        raise ValueError(
            f"group_size ({group_size}) must be >= 1; pass --n-samples-per-prompt, the number of "
            "samples drawn per prompt"
        )
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards (shape {tuple(rewards.shape)}) must be 1-D with a length that is a multiple of "
            f"group_size ({group_size}); the batch must hold whole groups of consecutive samples"
        )
    return rewards.view(-1, group_size)  # (G, group_size)


def _zero_spread(groups: Tensor) -> Tensor:
    # All-equal groups are compared exactly: a rounded group mean would leave tiny nonzero residues.
    return (groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)).expand_as(groups)


def group_normalize_rewards(
    rewards: Tensor, group_size: int, std_normalization: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO group-relative advantages (Shao et al. 2024, DeepSeekMath; dr_grpo: Liu et al. 2025).

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps) with the unbiased std (correction=1), or
    A_i = r_i - mean_g(r) when `std_normalization` is False (dr_grpo). Groups are `group_size`
    consecutive samples of `rewards` (B,). A group whose rewards are all equal, including every
    group of size 1 (std undefined), gets exactly 0, never NaN.
    """
    groups = _grouped(rewards, group_size)  # (G, group_size)
    if groups.numel() == 0:
        return rewards.clone()
    centered = groups - groups.mean(dim=1, keepdim=True)  # (G, group_size)
    if std_normalization and group_size > 1:
        centered = centered / (groups.std(dim=1, keepdim=True) + eps)
    return torch.where(_zero_spread(groups), 0.0, centered).reshape(-1)  # (B,)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024).

    A_i = r_i - 1/(n-1) * sum_{j != i} r_j within each group of `group_size` consecutive samples
    of `rewards` (B,). Groups of size 1 (no other sample) and all-equal groups get exactly 0.
    """
    groups = _grouped(rewards, group_size)  # (G, group_size)
    if group_size == 1 or groups.numel() == 0:
        return torch.zeros_like(rewards)
    baseline = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)  # (G, group_size)
    return torch.where(_zero_spread(groups), 0.0, groups - baseline).reshape(-1)  # (B,)
