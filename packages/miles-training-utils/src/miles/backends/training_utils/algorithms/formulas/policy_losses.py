"""Per-token losses before reduction: PPO's clipped surrogate (with dual clip, and GSPO's sequence
ratio), PPO's clipped value loss, and SFT's negative log-likelihood.

Reducing them over tokens and samples is left to the caller (`loss.reduce_loss`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles.backends.training_utils.algorithms.formulas._segments import (
    _check_same_shape,
    _masked_segment_mean,
    _segments,
)

__all__ = ["compute_gspo_kl", "compute_policy_loss", "compute_sft_loss", "compute_value_loss"]


def compute_policy_loss(
    ppo_kl: Tensor,
    advantages: Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate per token (Schulman et al. 2017), with optional dual clip.

    ratio = exp(-ppo_kl), where ppo_kl = old_log_probs - log_probs;
    loss = max(-A * ratio, -A * clamp(ratio, 1 - eps_clip, 1 + eps_clip_high)); the second term
    winning (strictly) marks the token as clipped. Dual clip (Ye et al. 2020, "Mastering Complex
    Control in MOBA Games"): for A < 0, loss = min(loss, -A * eps_clip_c), eps_clip_c > 1.
    Returns (loss, clipped as 0./1.), both shaped like the inputs; a tie counts as unclipped, so
    the gradient there is the unclipped one. The ratio is not clamped (as in slime): it overflows
    only for |ppo_kl| beyond ~88 (float32) or ~709 (float64).
    """
    _check_same_shape("ppo_kl", ppo_kl, "advantages", advantages)
    if not 0.0 <= eps_clip <= 1.0:
        raise ValueError(f"eps_clip (--eps-clip) is {eps_clip}; it must be in [0, 1], e.g. 0.2")
    if eps_clip_high < 0.0:
        raise ValueError(
            f"eps_clip_high (--eps-clip-high) is {eps_clip_high}; it must be >= 0, e.g. 0.28"
        )
    if eps_clip_c is not None and not eps_clip_c > 1.0:
        raise ValueError(
            f"eps_clip_c (--eps-clip-c) is {eps_clip_c}; dual clip needs a bound > 1.0, e.g. 3.0, "
            "or leave it unset to disable dual clip"
        )
    ratio = (-ppo_kl).exp()  # same shape as ppo_kl
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    # where(), not maximum(): on a tie (e.g. ratio 1 with eps_clip_high 0) maximum() would split
    # the gradient in half; the unclipped branch keeps it whole.
    clipped = loss_clipped > loss_unclipped
    loss = torch.where(clipped, loss_clipped, loss_unclipped)
    if eps_clip_c is not None:
        dual = -advantages * eps_clip_c
        loss = torch.where((advantages < 0) & (dual < loss), dual, loss)
    return loss, clipped.to(ppo_kl.dtype)


def compute_sft_loss(log_probs: Tensor) -> Tensor:
    """Per-token negative log-likelihood, -log p(y_t) (supervised fine-tuning)."""
    return -log_probs


def compute_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, value_clip: float
) -> tuple[Tensor, Tensor]:
    """PPO clipped value loss per token (Schulman et al. 2017; as in OpenAI baselines ppo2).

    v_clip = old + clamp(v - old, -value_clip, value_clip);
    loss = 0.5 * max((v - R)^2, (v_clip - R)^2). Returns (loss, clipped as 0./1., where the clipped
    term is strictly larger), both shaped like `values`.
    """
    _check_same_shape("values", values, "old_values", old_values)
    _check_same_shape("values", values, "returns", returns)
    if value_clip < 0.0:
        raise ValueError(f"value_clip (--value-clip) is {value_clip}; it must be >= 0, e.g. 0.2")
    values_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    loss_unclipped = (values - returns).square()
    loss_clipped = (values_clipped - returns).square()
    # Ties keep the unclipped gradient, as in the policy loss.
    clipped = loss_clipped > loss_unclipped
    loss = 0.5 * torch.where(clipped, loss_clipped, loss_unclipped)
    return loss, clipped.to(values.dtype)


# ---------------------------------------------------------------- sequence-level ratios


def compute_gspo_kl(
    log_probs: Tensor,
    old_log_probs: Tensor,
    loss_masks: list[Tensor] | None,
    response_lengths: list[int],
) -> Tensor:
    """Per-token ppo_kl carrying GSPO's sequence-level ratio (Zheng et al. 2025, GSPO-token form).

    seq_kl_i = masked mean over sample i's tokens of (old_t - new_t), i.e. -log of the sequence
    ratio s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|); no mask means all tokens count, an empty mask
    gives 0. GSPO-token sets s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)] (sg: stop-gradient), so
    ppo_kl_t = sg[seq_kl_i] - new_t + sg[new_t]: its value is exactly seq_kl_i and its gradient
    w.r.t. log_probs[t] is -1, as for a token-level ratio. Inputs are concatenated over samples,
    (sum(response_lengths),); nonzero mask entries are trainable.
    """
    _check_same_shape("log_probs", log_probs, "old_log_probs", old_log_probs)
    ids, mask = _segments("log_probs", log_probs, loss_masks, response_lengths)
    new = log_probs.detach()
    seq_kl = _masked_segment_mean(old_log_probs.detach() - new, mask, ids, len(response_lengths))
    # new - log_probs is exactly 0 in value, so the value is exactly seq_kl_i.
    return seq_kl[ids] + (new - log_probs)  # (N,)
