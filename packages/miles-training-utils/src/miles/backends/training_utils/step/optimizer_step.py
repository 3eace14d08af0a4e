"""One optimizer step over an engine, as the policy's and the critic's steps both take it: the
loss normalizer of the global batch, the micro-batches' forward and backward, the step, and the
metrics reduced over the data-parallel replicas."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles.backends.training_utils.algorithms.loss import LossNormalizer
from miles.backends.training_utils.batching.rollout_data import RolloutBatch
from miles.backends.training_utils.infra.device import collective_device
from miles.backends.training_utils.infra.metrics import aggregate_train_losses
from miles.backends.training_utils.step.train_engine import (
    MicroBatchLoss,
    OptimizerStepResult,
    TrainEngine,
)

logger = logging.getLogger(__name__)


def all_reduce_over_replicas(engine: TrainEngine, values: Tensor, op: Any = None) -> Tensor:
    """`values` (float64, CPU) reduced over the engine's data-parallel replicas (SUM by
    default)."""
    group = engine.dp_group
    if group is None:
        return values
    on_device = values.to(collective_device(group))
    dist.all_reduce(on_device, op=op or dist.ReduceOp.SUM, group=group)
    return on_device.cpu()


def loss_normalizer(
    engine: TrainEngine, step_batch: RolloutBatch, global_batch_size: int
) -> LossNormalizer:
    """The normalizer of one global batch: its samples and its trainable tokens on every rank."""
    local_tokens = torch.tensor(
        [float(sum(sum(mask) for mask in step_batch["loss_mask"]))], dtype=torch.float64
    )
    return LossNormalizer(
        num_samples=global_batch_size,
        num_tokens=int(all_reduce_over_replicas(engine, local_tokens).item()),
        dp_size=engine.dp_size,
    )


def loss_pair(loss: Tensor, micro_batches: int) -> Tensor:
    """A micro-batch's `loss` metric pair. Each micro-batch's loss carries reduce_loss's x dp
    factor; weighted 1 / (micro-batches per rank), the weights over every rank add up to dp, so
    the mean is the global batch's loss."""
    weight = torch.tensor(1.0 / micro_batches, dtype=torch.float64)
    return torch.stack([loss.detach().double().cpu(), weight])


def take_optimizer_step(
    engine: TrainEngine, micro_batches: Sequence[RolloutBatch], loss_fn: MicroBatchLoss, what: str
) -> tuple[dict[str, float], OptimizerStepResult]:
    """Forward and backward every micro-batch, step; the metrics reduced over the replicas and
    the step's result (`what` names the step in the log when it is skipped)."""
    engine.zero_grad()
    pairs = engine.forward_backward(micro_batches, loss_fn)
    result = engine.optimizer_step()
    if not result.applied:
        logger.warning("%s step skipped: gradient norm %s", what, result.grad_norm)
    return aggregate_train_losses(pairs, group=engine.dp_group), result
