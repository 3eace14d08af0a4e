"""A user's loss and advantage estimator, as `--custom-loss-function-path` and
`--custom-advantage-function-path` load them (test_megatron_matches_fsdp trains with both)."""

from __future__ import annotations

import torch

from miles.backends.training_utils.algorithms.loss import reduce_loss
from miles.backends.training_utils.algorithms.registry import LossSpec
from miles.backends.training_utils.infra.metrics import token_weighted


def reward_sign(batch, config, masks, group):
    """+1 on every token of a sample with a positive reward, -1 otherwise (a plain function:
    loaded with the default estimator settings)."""
    advantages = [
        torch.full_like(mask, 1.0 if reward > 0 else -1.0)
        for mask, reward in zip(masks, batch["rewards"], strict=True)
    ]
    return advantages, advantages


def _reinforce(inputs, config, normalizer):
    """REINFORCE: -A * log pi per token, reduced like the built-in losses."""
    mask = inputs["loss_mask"]
    per_token = -inputs["advantages"] * inputs["log_probs"]
    loss = reduce_loss(
        per_token, mask, inputs["response_lengths"], config=config, normalizer=normalizer
    )
    return loss, {"reinforce_loss": token_weighted(per_token.detach(), mask)}


REINFORCE = LossSpec(fn=_reinforce, inputs=frozenset({"advantages"}))
"""A spec, so it declares its inputs: advantages only, no old-policy forward."""


def no_advantage(batch, config, masks, group):
    """Zero on every token: the task reward teaches nothing, so what a run learns comes from
    elsewhere (test_cpu_demo's distillation: the teacher's KL, added after the estimator)."""
    advantages = [torch.zeros_like(mask, dtype=torch.float32) for mask in masks]
    return advantages, advantages
