"""`CriticTrainer`: the value model's side of PPO (--advantage-estimator ppo), written once for every
backend (architecture.md: "PPO and the critic").

The critic is a second `TrainEngine` whose "log-probs" are values: per response token, the
model's scalar estimate of the return from the state before that token (a token-classification
head with one label, on the position that predicts the token). Before the policy's step the
critic scores the rollout (`values`), GAE turns rewards and values into advantages and returns;
after it, the critic takes its own optimizer steps on the same batches with PPO's clipped value
loss against those returns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from miles.backends.training_utils.algorithms.loss import value_loss_function
from miles.backends.training_utils.algorithms.loss_config import LossConfig
from miles.backends.training_utils.batching.rollout_data import (
    RolloutBatch,
    batch_size,
    select_rows,
)
from miles.backends.training_utils.batching.train_batches import DataIterator, token_columns
from miles.backends.training_utils.step.optimizer_step import (
    all_reduce_over_replicas,
    loss_normalizer,
    loss_pair,
    take_optimizer_step,
)
from miles.backends.training_utils.step.train_engine import TrainEngine

logger = logging.getLogger(__name__)

CRITIC_COLUMNS = ("values", "returns")
"""What the critic's step reads from the batch, besides the loss mask: the values it gave before
the policy's step (the clip's anchor) and GAE's returns (its targets)."""


class CriticTrainer:
    """The critic's per-rollout work over its engine; every rank makes the same calls."""

    def __init__(
        self,
        engine: TrainEngine,
        loss: LossConfig,
        *,
        global_batch_size: int,
        micro_batches: Callable[[RolloutBatch], DataIterator],
    ) -> None:
        """`micro_batches` splits a batch as the policy's step does (`PolicyTrainer`)."""
        if global_batch_size % engine.dp_size:
            raise ValueError(
                f"--global-batch-size ({global_batch_size}) must be divisible by the critic's "
                f"data-parallel size ({engine.dp_size}); use a multiple of {engine.dp_size}"
            )
        self.engine = engine
        self.config = loss
        self.global_batch_size = global_batch_size
        self.micro_batches = micro_batches
        self.global_step = 0
        """The critic's optimizer steps so far (restored on resume)."""

    def values(self, batch: RolloutBatch) -> list[Tensor]:
        """Per-sample (R,) values of the shard's response tokens, no gradients."""
        iterator = self.micro_batches(batch)
        return iterator.per_sample(self.engine.forward_log_probs(list(iterator)))

    def train(self, batch: RolloutBatch) -> list[dict[str, float]]:
        """The critic's optimizer steps on this rank's shard (holding `values` and `returns`),
        as many as the policy takes; each step's `critic/...` metrics, with the rollout's
        explained variance, mean value and mean return."""
        missing = [name for name in CRITIC_COLUMNS if name not in batch]
        if missing:
            raise ValueError(f"the critic trains on the batch's {missing}, which it does not hold")
        rollout = self._rollout_metrics(batch)
        num_steps = batch_size(batch) * self.engine.dp_size // self.global_batch_size
        per_step = batch_size(batch) // num_steps
        metrics = []
        for step in range(num_steps):
            rows = range(step * per_step, (step + 1) * per_step)
            step_batch = select_rows(batch, rows)
            micro_batches = list(self.micro_batches(step_batch))
            metrics.append({**self._step(step_batch, micro_batches), **rollout})
        return metrics

    def _step(self, step_batch: RolloutBatch, micro_batches: list[RolloutBatch]) -> dict:
        normalizer = loss_normalizer(self.engine, step_batch, self.global_batch_size)

        def loss_fn(index: int, values: Tensor, entropy: Tensor, scored: Tensor | None):
            micro = micro_batches[index]
            columns = token_columns(micro, ["loss_mask", *CRITIC_COLUMNS])
            inputs: dict[str, Any] = {
                "values": values,
                "old_values": columns["values"].to(values.device),
                "returns": columns["returns"].to(values.device),
                "loss_mask": columns["loss_mask"].to(values.device),
                "response_lengths": micro["response_lengths"],
            }
            loss, metrics = value_loss_function(inputs, self.config, normalizer)
            metrics["loss"] = loss_pair(loss, len(micro_batches))
            return loss, metrics

        reduced, result = take_optimizer_step(self.engine, micro_batches, loss_fn, "critic")
        self.global_step += 1
        return {
            "critic/step": float(self.global_step),
            "critic/lr": float(result.lr),
            "critic/grad_norm": float(result.grad_norm),
            **{f"critic/{name}": float(value) for name, value in reduced.items()},
        }

    def _rollout_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        """Over every rank's trainable tokens: the mean value and return, the returns' variance,
        and the explained variance 1 - Var(returns - values) / Var(returns) of the values the
        critic gave (NaN when the returns do not vary). The returns' variance weighs a rollout's
        explained variance when several are pooled: one whose returns hardly vary has an
        explained variance that swings far either way and means little."""
        sums = torch.zeros(6, dtype=torch.float64)  # n, sum v, sum r, sum r^2, sum d, sum d^2
        for values, returns, mask in zip(
            batch["values"], batch["returns"], batch["loss_mask"], strict=True
        ):
            m = torch.as_tensor(mask, dtype=torch.float64)
            v = torch.as_tensor(values, dtype=torch.float64) * m
            r = torch.as_tensor(returns, dtype=torch.float64) * m
            d = r - v
            sums += torch.stack([m.sum(), v.sum(), r.sum(), (r * r).sum(), d.sum(), (d * d).sum()])
        n, v_sum, r_sum, r_sq, d_sum, d_sq = all_reduce_over_replicas(self.engine, sums).tolist()
        n = max(n, 1.0)
        var_returns = r_sq / n - (r_sum / n) ** 2
        var_residual = d_sq / n - (d_sum / n) ** 2
        explained = 1.0 - var_residual / var_returns if var_returns > 0 else float("nan")
        return {
            "critic/values_mean": v_sum / n,
            "critic/returns_mean": r_sum / n,
            "critic/returns_variance": var_returns,
            "critic/explained_variance": explained,
        }
