"""The RL algorithm formulas: advantages, KL estimators, policy/value/SFT losses, off-policy weights.

Pure functions over tensors; each cites its paper and has a float64 reference in the tests.
Loss reduction (per token, per sample, constant normalizer) is deliberately left to the caller.
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles.backends.training_utils.loss_config import KL_TYPES, KLType

# exp(20) ~ 4.9e8: keeps the k3 estimator finite when the reference model is far more likely.
_K3_MAX_NEG_LOG_RATIO = 20.0
# verl and slime clamp low_var_kl to this range.
_LOW_VAR_KL_BOUND = 10.0

__all__ = [
    "KL_TYPES",
    "KLType",
    "compute_approx_kl",
    "compute_gspo_kl",
    "compute_icepop_weights",
    "compute_mis_weights",
    "compute_policy_loss",
    "compute_sft_loss",
    "compute_tis_weights",
    "compute_value_loss",
    "get_gae_advantages_and_returns",
    "get_reinforce_plus_plus_returns",
    "group_normalize_rewards",
    "rloo_advantages",
    "whiten",
]


# ---------------------------------------------------------------- group baselines


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


# ---------------------------------------------------------------- KL and policy losses


def _check_same_shape(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"{name_a} (shape {tuple(a.shape)}) and {name_b} (shape {tuple(b.shape)}) must have the "
            "same shape; pass per-token tensors over the same tokens"
        )


def compute_approx_kl(log_probs: Tensor, ref_log_probs: Tensor, kl_type: KLType) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating KL").

    With x = log_probs - ref_log_probs: k1 = x; k2 = x^2 / 2; k3 = exp(-x) - 1 + x. `low_var_kl`
    is k3 clamped to [-10, 10], as verl and slime do. For k3 and low_var_kl, -x is first clamped
    to at most 20 (in both terms) to keep exp finite; beyond that point the value is constant and
    its gradient zero. k3 is computed as expm1(-x) + x, clamped at 0 against rounding, so it is
    accurate for tiny x and never negative.
    """
    _check_same_shape("log_probs", log_probs, "ref_log_probs", ref_log_probs)
    log_ratio = log_probs - ref_log_probs  # same shape as log_probs
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio.square()
    if kl_type in ("k3", "low_var_kl"):
        neg = (-log_ratio).clamp(max=_K3_MAX_NEG_LOG_RATIO)
        kl = (torch.expm1(neg) - neg).clamp(min=0.0)
        if kl_type == "low_var_kl":
            kl = kl.clamp(min=-_LOW_VAR_KL_BOUND, max=_LOW_VAR_KL_BOUND)
        return kl
    raise ValueError(f"unknown kl_type {kl_type!r} (--kl-loss-type); choose one of {KL_TYPES}")


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


# ---------------------------------------------------------------- train/inference mismatch


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


# ---------------------------------------------------------------- returns and GAE


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
