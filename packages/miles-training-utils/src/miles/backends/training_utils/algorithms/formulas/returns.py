"""Per-token returns and advantages over trainable tokens: REINFORCE++ returns, GAE, whitening.

Masked tokens (tool or observation output) are skipped, not discounted through. Pure functions
over one (L_i,) tensor per sample.
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles.backends.training_utils.algorithms.formulas._segments import _check_same_shape

__all__ = ["get_gae_advantages_and_returns", "get_reinforce_plus_plus_returns", "whiten"]


def _check_per_sample(names: tuple[str, ...], *seqs: list[Tensor]) -> None:
    counts = [len(s) for s in seqs]
    if len(set(counts)) > 1:
        raise ValueError(
            f"{', '.join(names)} hold {counts} samples; pass one tensor per sample to each"
        )
    for i, tensors in enumerate(zip(*seqs, strict=True)):
        shapes = [tuple(t.shape) for t in tensors]
        if len(set(shapes)) > 1 or len(shapes[0]) != 1:
            raise ValueError(
                f"sample {i}: {', '.join(names)} have shapes {shapes}; each must be 1-D over the "
                "same response tokens"
            )


def _check_discount(name: str, flag: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} ({flag}) is {value}; it must be in [0, 1], e.g. 1.0")


def _pack_trainable(seqs: list[Tensor], positions: list[Tensor]) -> Tensor:
    """Each sample's trainable entries, left-aligned and zero-padded on the right. (B, L_max)"""
    width = max((p.numel() for p in positions), default=0)
    packed = seqs[0].new_zeros(len(seqs), width)  # (B, L_max)
    for i, (x, p) in enumerate(zip(seqs, positions, strict=True)):
        packed[i, : p.numel()] = x[p]
    return packed


def _unpack_trainable(packed: Tensor, like: list[Tensor], positions: list[Tensor]) -> list[Tensor]:
    out = [torch.zeros_like(x) for x in like]
    for i, p in enumerate(positions):
        out[i][p] = packed[i, : p.numel()]
    return out


def _discounted_reverse_cumsum(x: Tensor, discount: float) -> Tensor:
    """y_t = x_t + discount * y_{t+1} along dim 1, y after the end = 0. (B, L)"""
    out = torch.empty_like(x)
    running = x.new_zeros(x.shape[0])  # (B,)
    for t in range(x.shape[1] - 1, -1, -1):
        running = x[:, t] + discount * running
        out[:, t] = running
    return out


def get_reinforce_plus_plus_returns(
    token_rewards: list[Tensor], loss_masks: list[Tensor], gamma: float
) -> list[Tensor]:
    """Discounted return-to-go per token (REINFORCE++, Hu 2025), over trainable tokens only.

    Per sample, with t, t+1, ... the trainable (mask != 0) tokens in order: G_t = r_t + gamma *
    G_{t+1}. Masked tokens (tool / observation output) are skipped: they get return 0, their
    rewards are ignored, and they do not discount the chain. Returns one (L_i,) tensor per sample.
    """
    _check_per_sample(("token_rewards", "loss_masks"), token_rewards, loss_masks)
    _check_discount("gamma", "--gamma", gamma)
    if not token_rewards:
        return []
    positions = [m.reshape(-1).nonzero().squeeze(-1) for m in loss_masks]
    packed = _pack_trainable(token_rewards, positions)  # (B, L_max)
    # Right padding is 0, so it adds nothing to the returns of real tokens.
    return _unpack_trainable(_discounted_reverse_cumsum(packed, gamma), token_rewards, positions)


def get_gae_advantages_and_returns(
    rewards: list[Tensor],
    values: list[Tensor],
    loss_masks: list[Tensor],
    gamma: float,
    lam: float,
) -> tuple[list[Tensor], list[Tensor]]:
    """Generalized advantage estimation (Schulman et al. 2016) over trainable tokens only.

    Per sample, on the sequence of trainable (mask != 0) tokens: delta_t = r_t + gamma * V_{t+1}
    - V_t with V = 0 after the last trainable token, A_t = delta_t + gamma * lam * A_{t+1},
    R_t = A_t + V_t. Masked tokens get advantage 0 and return 0 and their rewards are ignored.
    Returns (advantages, returns), one (L_i,) tensor per sample each.
    """
    _check_per_sample(("rewards", "values", "loss_masks"), rewards, values, loss_masks)
    _check_discount("gamma", "--gamma", gamma)
    _check_discount("lam", "--lambd", lam)
    if not rewards:
        return [], []
    positions = [m.reshape(-1).nonzero().squeeze(-1) for m in loss_masks]
    r = _pack_trainable(rewards, positions)  # (B, L_max)
    v = _pack_trainable(values, positions)  # (B, L_max)
    # Right padding is 0: the value after each sample's last trainable token is 0, and padded
    # deltas are 0, so padding does not leak into real tokens.
    v_next = torch.cat([v[:, 1:], v.new_zeros(v.shape[0], 1)], dim=1)  # (B, L_max)
    advantages = _discounted_reverse_cumsum(r + gamma * v_next - v, gamma * lam)  # (B, L_max)
    returns = advantages + v
    return (
        _unpack_trainable(advantages, rewards, positions),
        _unpack_trainable(returns, rewards, positions),
    )


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8, shift_mean: bool = True) -> Tensor:
    """Masked whitening across every token of the batch (as in REINFORCE++, Hu 2025).

    Over the n tokens with mask != 0: mu = mean(x), var = mean((x - mu)^2) (population variance);
    out = (x - mu) / sqrt(var + eps), plus mu again when `shift_mean` is False. Tokens with mask 0
    give 0. With n < 2 there is no spread to divide by: out = x - mu (all 0) when shifting the
    mean, else x unchanged, on the masked tokens.
    """
    _check_same_shape("values", values, "mask", mask)
    keep = mask.to(values.device, torch.bool)
    n = int(keep.sum())
    x = torch.where(keep, values, 0.0)
    mean = x.sum() / max(n, 1)
    centered = torch.where(keep, values - mean, 0.0)
    if n >= 2:
        var = centered.square().sum() / n
        centered = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        centered = torch.where(keep, centered + mean, 0.0)
    return centered
