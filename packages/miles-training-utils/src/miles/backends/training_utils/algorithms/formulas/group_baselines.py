"""Group-relative baselines: GRPO's normalized rewards and RLOO's leave-one-out advantages.

A group is `group_size` consecutive samples drawn for one prompt; every sample's reward is compared
with the others of its group. Pure functions over (B,) rewards.

Safe for any finite reward: a group with a reward beyond 2**256 in magnitude is divided by a power
of two above its largest one before its sum or variance is taken (exact: only the exponent moves),
so 1e308 neither overflows the sum nor, squared, the variance. Other groups take the plain path.
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


_SCALE_ABOVE = 2.0**256
"""Groups with a larger magnitude are scaled: squares of 2**256 times a group size stay finite."""


def _scales(groups: Tensor) -> Tensor:
    """(G, 1) per-group divisors: the power of two that brings the group's largest magnitude
    into [1, 2) where it exceeds `_SCALE_ABOVE`, else 1 (ordinary rewards keep their exact
    arithmetic). Not into [0.5, 1): that power, 2**1024 for rewards near float's maximum, is inf."""
    largest = groups.abs().amax(dim=1, keepdim=True)  # (G, 1)
    _, exponent = torch.frexp(largest)  # largest = m * 2**exponent, 0.5 <= m < 1
    power = torch.ldexp(torch.ones_like(largest), exponent - 1)
    return torch.where(largest > _SCALE_ABOVE, power, torch.ones_like(largest))


def _unscaled(values: Tensor, scales: Tensor, groups: Tensor) -> Tensor:
    """`values` (scaled differences of rewards) times their group's scale; a result past
    float's range is refused rather than turned into inf."""
    out = values * scales
    if not torch.isfinite(out).all():
        bad = int((~torch.isfinite(out)).any(dim=1).nonzero()[0, 0])
        raise ValueError(
            f"group {bad}'s rewards (from {groups[bad].min().item():g} to "
            f"{groups[bad].max().item():g}) spread beyond the largest float: its advantages "
            "cannot be represented; bound the rewards with --reward-clip"
        )
    return out


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
    scales = _scales(groups)  # (G, 1)
    scaled = groups / scales  # (G, group_size), exact: the divisors are powers of two
    centered = scaled - scaled.mean(dim=1, keepdim=True)  # (G, group_size), in units of scales
    if std_normalization and group_size > 1:
        # (r - mean) / (std + eps) with every term divided by the scale: the ratio is unchanged.
        centered = centered / (scaled.std(dim=1, keepdim=True) + eps / scales)
    else:
        centered = _unscaled(centered, scales, groups)
    return torch.where(_zero_spread(groups), 0.0, centered).reshape(-1)  # (B,)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024).

    A_i = r_i - 1/(n-1) * sum_{j != i} r_j within each group of `group_size` consecutive samples
    of `rewards` (B,). Groups of size 1 (no other sample) and all-equal groups get exactly 0.
    """
    groups = _grouped(rewards, group_size)  # (G, group_size)
    if group_size == 1 or groups.numel() == 0:
        return torch.zeros_like(rewards)
    scales = _scales(groups)  # (G, 1)
    scaled = groups / scales  # exact: the divisors are powers of two
    baseline = (scaled.sum(dim=1, keepdim=True) - scaled) / (group_size - 1)  # (G, group_size)
    advantages = _unscaled(scaled - baseline, scales, groups)
    return torch.where(_zero_spread(groups), 0.0, advantages).reshape(-1)  # (B,)
