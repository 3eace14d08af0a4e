"""`Algorithm`: what a run's `LossConfig` resolves to, and the two entry points that run it.

The registry (`registry`) declares the losses and estimators; `LossConfig` checks its names
against it; this module, above both, pairs a config with its entries (`Algorithm.from_config`),
tells the step which batch inputs to compute, and shapes rewards (rollout side) and computes
advantages (train side) with the chosen estimator. Importing it imports no torch: the driver reads
`Algorithm.needs_reference` while it validates the configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles.backends.training_utils.algorithms.registry import (
    EstimatorSpec,
    LossSpec,
    estimator_spec,
    loss_spec,
)

if TYPE_CHECKING:
    from torch import Tensor

    from miles.backends.training_utils.algorithms.loss_config import LossConfig
    from miles.backends.training_utils.batching.rollout_data import RolloutBatch

__all__ = ["Algorithm", "compute_advantages_and_returns", "shape_rewards"]


@dataclass(frozen=True)
class Algorithm:
    """What a run's LossConfig resolves to: the loss, the estimator and the inputs to compute."""

    config: LossConfig
    loss: LossSpec
    estimator: EstimatorSpec

    @classmethod
    def from_config(cls, config: LossConfig) -> Algorithm:
        return cls(config, loss_spec(config), estimator_spec(config))

    @property
    def inputs(self) -> frozenset[str]:
        """Every batch input the step computes: the loss's, the estimator's when the loss reads
        advantages, and those the KL and off-policy settings read."""
        config, needed = self.config, set(self.loss.inputs)
        if "advantages" in needed:
            needed |= self.estimator.inputs
            if config.kl_coef:  # a KL penalty folded into token rewards
                needed |= {"old_log_probs", "ref_log_probs"}
        if config.use_kl_loss:
            needed.add("ref_log_probs")
        if config.off_policy_correction is not None:
            needed |= {"old_log_probs", "rollout_log_probs"}
        return frozenset(needed)

    @property
    def needs_reference(self) -> bool:
        return "ref_log_probs" in self.inputs


def shape_rewards(raw_rewards: Tensor, config: LossConfig, *, group_size: int) -> Tensor:
    """Per-sample rewards as --advantage-estimator consumes them (on the rollout side, over the
    whole rollout): group-normalized (grpo, gspo), group-centred (dr_grpo,
    reinforce_plus_plus_baseline), leave-one-out (rloo) or raw."""
    shape = estimator_spec(config).shape_function
    return shape(raw_rewards.double(), group_size, config).to(raw_rewards.dtype)


def compute_advantages_and_returns(
    batch: RolloutBatch, config: LossConfig, *, group: Any = None
) -> None:
    """Add `advantages` and `returns` (per-sample (response_length,) tensors) to `batch`.

    `batch["rewards"]` holds the output of `shape_rewards`. The rule reads `loss_mask`, and
    `old_log_probs` and `ref_log_probs` when --kl-coef is set, `values` for ppo. `group` is the
    data-parallel process group over which batch-level statistics are reduced (None: the default
    group, if any).
    """
    # Imported here: reading the registry must not import torch.
    from miles.backends.training_utils.algorithms.advantages import loss_masks

    rule = estimator_spec(config).advantage_function
    batch["advantages"], batch["returns"] = rule(batch, config, loss_masks(batch), group)
