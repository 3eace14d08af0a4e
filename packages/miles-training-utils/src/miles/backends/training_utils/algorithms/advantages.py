"""From rewards to per-token advantages and returns: the two functions of every built-in estimator.

A *shaper* runs on the rollout side over a whole global batch (groups are consecutive
`n_samples_per_prompt` samples); a *rule* runs on each train rank over its shard. Estimators that
whiten over the batch (the REINFORCE++ family) reduce their statistics across the ranks of
`group`, so every rank whitens with the global mean and variance. Which estimator uses which pair
is declared once, in `registry.ESTIMATORS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from miles.backends.training_utils.algorithms.formulas.group_baselines import (
    group_normalize_rewards,
    rloo_advantages,
)
from miles.backends.training_utils.algorithms.formulas.kl import compute_approx_kl
from miles.backends.training_utils.algorithms.formulas.returns import (
    get_gae_advantages_and_returns,
    get_reinforce_plus_plus_returns,
)
from miles.backends.training_utils.batching.rollout_data import RolloutBatch
from miles.backends.training_utils.infra.device import collective_device

if TYPE_CHECKING:
    from miles.backends.training_utils.algorithms.loss_config import LossConfig

Advantages = tuple[list[Tensor], list[Tensor]]
"""(advantages, returns): one (response_length,) tensor per sample each."""


# -- shapers: (B,) raw rewards -> (B,) rewards as the estimator consumes them --------------------


def group_normalized(raw_rewards: Tensor, group_size: int, config: LossConfig) -> Tensor:
    """grpo, gspo: (r - group mean) / group std (the std only with --grpo-std-normalization)."""
    return group_normalize_rewards(
        raw_rewards, group_size, std_normalization=config.grpo_std_normalization
    )


def group_centred(raw_rewards: Tensor, group_size: int, config: LossConfig) -> Tensor:
    """dr_grpo, reinforce_plus_plus_baseline: r - group mean."""
    return group_normalize_rewards(raw_rewards, group_size, std_normalization=False)


def leave_one_out(raw_rewards: Tensor, group_size: int, config: LossConfig) -> Tensor:
    """rloo: r minus the mean of the group's other rewards."""
    return rloo_advantages(raw_rewards, group_size)


def unshaped(raw_rewards: Tensor, group_size: int, config: LossConfig) -> Tensor:
    """reinforce_plus_plus, ppo and custom estimators: the raw reward itself."""
    return raw_rewards.clone()


# -- rules: a rank's shard -> per-token advantages and returns --------------------------------


def loss_masks(batch: RolloutBatch) -> list[Tensor]:
    """The shard's loss masks as float32 (R,) tensors, the `masks` argument of every rule."""
    return [torch.as_tensor(m, dtype=torch.float32) for m in batch["loss_mask"]]


def _token_rewards(batch: RolloutBatch, config: LossConfig, masks: list[Tensor]) -> list[Tensor]:
    """Per-token rewards: -kl_coef * KL(k1) on every token, the sample's reward on its last
    trainable token (the last token the policy produced)."""
    token_rewards = []
    for i, mask in enumerate(masks):
        rewards = torch.zeros_like(mask)  # (R,)
        if config.kl_coef:
            kl = compute_approx_kl(
                torch.as_tensor(batch["old_log_probs"][i]),
                torch.as_tensor(batch["ref_log_probs"][i]),
                "k1",
            )
            rewards -= config.kl_coef * kl.float()
        trainable = mask.nonzero()
        if len(trainable):
            rewards[trainable[-1, 0]] += float(batch["rewards"][i])
        token_rewards.append(rewards)
    return token_rewards


def global_whiten(
    values: list[Tensor], masks: list[Tensor], group=None, eps: float = 1e-8
) -> list[Tensor]:
    """Whiten trainable tokens with the mean and (population) variance of every rank's tokens.

    Masked tokens come back as 0. With one trainable token overall there is no spread: values
    are centred only.
    """
    flat_values, flat_masks = torch.cat(values).double(), torch.cat(masks).double()  # (N,)
    stats = torch.stack(
        [(flat_values * flat_masks).sum(), (flat_values**2 * flat_masks).sum(), flat_masks.sum()]
    )
    if group is not None or (dist.is_available() and dist.is_initialized()):
        # Rollout values arrive on the CPU; nccl / hccl reduce only device tensors.
        stats = stats.to(collective_device(group))
        dist.all_reduce(stats, group=group)
    total, total_sq, count = stats.tolist()
    if count == 0:
        return [torch.zeros_like(v) for v in values]
    mean = total / count
    var = max(total_sq / count - mean * mean, 0.0)
    scale = 1.0 / (var + eps) ** 0.5 if count > 1 else 1.0
    return [
        ((v.double() - mean) * scale * m).to(v.dtype) for v, m in zip(values, masks, strict=True)
    ]


def broadcast_reward(
    batch: RolloutBatch, config: LossConfig, masks: list[Tensor], group
) -> Advantages:
    """grpo, dr_grpo, gspo, rloo: the shaped sample reward on every response token."""
    advantages = [
        torch.full_like(m, float(r)) for m, r in zip(masks, batch["rewards"], strict=True)
    ]
    return advantages, advantages


def reinforce_plus_plus(
    batch: RolloutBatch, config: LossConfig, masks: list[Tensor], group
) -> Advantages:
    """REINFORCE++ (Hu 2025): discounted token returns, whitened over the global batch."""
    returns = get_reinforce_plus_plus_returns(
        _token_rewards(batch, config, masks), masks, config.gamma
    )
    return global_whiten(returns, masks, group), returns


def reinforce_plus_plus_baseline(
    batch: RolloutBatch, config: LossConfig, masks: list[Tensor], group
) -> Advantages:
    """REINFORCE++-baseline: group-centred reward on every token minus the per-token KL
    penalty, whitened over the global batch."""
    shaped = [torch.full_like(m, float(r)) for m, r in zip(masks, batch["rewards"], strict=True)]
    if config.kl_coef:
        penalties = _token_rewards({**batch, "rewards": [0.0] * len(masks)}, config, masks)
        shaped = [s + p for s, p in zip(shaped, penalties, strict=True)]
    advantages = global_whiten(shaped, masks, group)
    return advantages, advantages


def gae(batch: RolloutBatch, config: LossConfig, masks: list[Tensor], group) -> Advantages:
    """PPO: GAE over trainable tokens with the critic's values."""
    values = [torch.as_tensor(v, dtype=torch.float32) for v in batch["values"]]
    rewards = _token_rewards(batch, config, masks)
    return get_gae_advantages_and_returns(rewards, values, masks, config.gamma, config.lambd)
