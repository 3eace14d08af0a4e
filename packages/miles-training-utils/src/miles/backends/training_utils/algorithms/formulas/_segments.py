"""Argument checks and per-sample segments shared by the formula modules.

Per-token inputs of several samples arrive concatenated, (sum of response lengths,); these helpers
check shapes and reduce over each sample's tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_same_shape(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"{name_a} (shape {tuple(a.shape)}) and {name_b} (shape {tuple(b.shape)}) must have the "
            "same shape; pass per-token tensors over the same tokens"
        )


def _segments(
    name: str, tokens: Tensor, loss_masks: list[Tensor] | None, response_lengths: list[int]
) -> tuple[Tensor, Tensor]:
    """Validate concatenated per-token data; return (sample id per token, bool mask), both (N,)."""
    if tokens.dim() != 1 or tokens.numel() != sum(response_lengths):
        raise ValueError(
            f"{name} (shape {tuple(tokens.shape)}) must be 1-D with sum(response_lengths) "
            f"({sum(response_lengths)}) tokens: all samples' response tokens, concatenated"
        )
    if any(n < 0 for n in response_lengths):
        raise ValueError(f"response_lengths {response_lengths} must all be >= 0")
    if loss_masks is not None and [m.numel() for m in loss_masks] != list(response_lengths):
        raise ValueError(
            f"loss_masks lengths {[m.numel() for m in loss_masks]} differ from response_lengths "
            f"{list(response_lengths)}; pass one mask per sample over its response tokens"
        )
    if loss_masks:
        mask = torch.cat([m.reshape(-1) for m in loss_masks]).to(tokens.device, torch.bool)  # (N,)
    else:  # no mask given (every token counts), or no samples at all
        mask = torch.ones_like(tokens, dtype=torch.bool)  # (N,)
    lengths = torch.tensor(response_lengths, dtype=torch.long, device=tokens.device)
    ids = torch.repeat_interleave(
        torch.arange(len(response_lengths), device=tokens.device), lengths
    )
    return ids, mask  # (N,), (N,)


def _masked_segment_mean(x: Tensor, mask: Tensor, ids: Tensor, n: int) -> Tensor:
    """Mean of x over each sample's masked tokens; 0 for a sample with no masked token. (n,)"""
    sums = x.new_zeros(n).index_add_(0, ids, torch.where(mask, x, 0.0))  # (n,)
    counts = x.new_zeros(n).index_add_(0, ids, mask.to(x.dtype))  # (n,)
    return sums / counts.clamp(min=1.0)
