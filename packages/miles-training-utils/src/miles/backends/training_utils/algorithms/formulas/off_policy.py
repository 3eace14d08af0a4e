"""Importance weights between the trainer's policy and the engine that sampled: TIS, IcePop, MIS.

The train and inference engines compute slightly different log-probs for the same tokens; these
weights correct (or mask) the policy loss for it. Detached; they multiply the per-token loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles.backends.training_utils.algorithms.formulas._segments import (
    _check_same_shape,
    _masked_segment_mean,
    _segments,
)

__all__ = ["compute_icepop_weights", "compute_mis_weights", "compute_tis_weights"]


def compute_tis_weights(
    train_log_probs: Tensor, rollout_log_probs: Tensor, clip_low: float, clip_high: float
) -> Tensor:
    """Truncated importance sampling weights (Yao et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training").

    w_t = clamp(exp(train_t - rollout_t), clip_low, clip_high), detached, shaped like the inputs.
    """
    _check_same_shape("train_log_probs", train_log_probs, "rollout_log_probs", rollout_log_probs)
    if not 0.0 <= clip_low <= 1.0 <= clip_high:
        raise ValueError(
            f"TIS clip range [{clip_low}, {clip_high}] (--tis-clip-low, --tis-clip-high) must satisfy "
            "0 <= clip_low <= 1 <= clip_high, e.g. [0, 2]"
        )
    ratio = (train_log_probs.detach() - rollout_log_probs.detach()).exp()
    return ratio.clamp(clip_low, clip_high)


def compute_icepop_weights(
    train_log_probs: Tensor, rollout_log_probs: Tensor, low: float, high: float
) -> Tensor:
    """IcePop token masking (Ling Team 2025, "Every Step Evolves", Ring-1T).

    ratio_t = exp(train_t - rollout_t); w_t = ratio_t if low <= ratio_t <= high else 0. Detached,
    shaped like the inputs. Tokens whose engines disagree too much drop out of the gradient.
    """
    _check_same_shape("train_log_probs", train_log_probs, "rollout_log_probs", rollout_log_probs)
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(
            f"IcePop band [{low}, {high}] (--icepop-low, --tis-clip-high) must satisfy 0 <= low <= 1 <= high so that on-policy "
            "tokens (ratio 1) are kept, e.g. [0.5, 2]"
        )
    ratio = (train_log_probs.detach() - rollout_log_probs.detach()).exp()
    return torch.where((ratio >= low) & (ratio <= high), ratio, 0.0)


def compute_mis_weights(
    train_log_probs: Tensor,
    rollout_log_probs: Tensor,
    loss_masks: list[Tensor],
    response_lengths: list[int],
    clip_high: float,
    veto_threshold: float,
) -> tuple[Tensor, Tensor]:
    """Sequence-level masked importance sampling with a catastrophic-token veto (Yao et al. 2025).

    For sample i over its masked tokens M_i: rho_i = exp(mean_{t in M_i}(train_t - rollout_t)),
    the geometric mean of the token ratios (1 when M_i is empty). Sample i is vetoed, weight 0 on
    all its tokens, if some t in M_i has exp(train_t - rollout_t) < veto_threshold, or if
    rho_i > clip_high. Otherwise every token of sample i gets weight rho_i.
    Returns (per-token weights (N,), detached; per-sample keep mask (n,) as 0./1.).
    """
    _check_same_shape("train_log_probs", train_log_probs, "rollout_log_probs", rollout_log_probs)
    if clip_high < 1.0:
        raise ValueError(
            f"MIS clip_high (--tis-clip-high) is {clip_high}; it must be >= 1 (e.g. 2) to keep on-policy samples"
        )
    if not 0.0 <= veto_threshold <= 1.0:
        raise ValueError(
            f"MIS veto_threshold (--mis-veto-threshold) is {veto_threshold}; it must be in [0, 1], e.g. 1e-4"
        )
    ids, mask = _segments("train_log_probs", train_log_probs, loss_masks, response_lengths)
    n = len(response_lengths)
    log_ratio = train_log_probs.detach() - rollout_log_probs.detach()  # (N,)
    seq_ratio = _masked_segment_mean(log_ratio, mask, ids, n).exp()  # (n,)
    catastrophic = (mask & (log_ratio.exp() < veto_threshold)).to(log_ratio.dtype)  # (N,)
    vetoed = log_ratio.new_zeros(n).index_add_(0, ids, catastrophic) > 0  # (n,)
    keep = ~vetoed & (seq_ratio <= clip_high)  # (n,)
    weights = torch.where(keep, seq_ratio, 0.0)[ids]  # (N,)
    return weights, keep.to(log_ratio.dtype)
