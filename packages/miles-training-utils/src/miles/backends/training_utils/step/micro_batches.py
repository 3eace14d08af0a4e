"""`MicroBatcher`: how one engine's train step splits a batch into micro-batches, shared by the
policy's step (`PolicyTrainer`) and the critic's (`CriticTrainer`), on the policy's ranks or on
ranks of its own."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from miles.backends.training_utils.batching.micro_batch import num_micro_batches
from miles.backends.training_utils.batching.rollout_data import RolloutBatch
from miles.backends.training_utils.batching.train_batches import DataIterator, get_data_iterator
from miles.backends.training_utils.step.optimizer_step import all_reduce_over_replicas
from miles.backends.training_utils.step.train_engine import TrainEngine


@dataclass(frozen=True)
class MicroBatcher:
    """Fixed micro-batches of `micro_batch_size` samples, or dynamic ones of at most
    `max_tokens_per_gpu` tokens (--use-dynamic-batch-size): exactly one of the two is set."""

    engine: TrainEngine
    micro_batch_size: int | None
    max_tokens_per_gpu: int | None

    def __post_init__(self) -> None:
        if (self.micro_batch_size is None) == (self.max_tokens_per_gpu is None):
            raise ValueError(
                "pass either micro_batch_size (fixed micro-batches) or max_tokens_per_gpu "
                f"(--use-dynamic-batch-size), got {self.micro_batch_size} and "
                f"{self.max_tokens_per_gpu}"
            )

    def __call__(self, batch: RolloutBatch) -> DataIterator:
        """Micro-batches of `batch`. Dynamic ones come in the same number on every
        data-parallel rank: a sharded forward or backward is a collective."""
        if self.max_tokens_per_gpu is None:
            return get_data_iterator(
                batch,
                micro_batch_size=self.micro_batch_size,
                max_tokens_per_gpu=None,
                use_dynamic_batch_size=False,
            )
        # A context-parallel rank holds 1/cp of every sequence: cp times the tokens fit.
        budget = self.max_tokens_per_gpu * self.engine.context_parallel_size
        count = torch.tensor([float(num_micro_batches(batch["total_lengths"], budget))])
        reduced = all_reduce_over_replicas(self.engine, count.double(), dist.ReduceOp.MAX)
        return get_data_iterator(
            batch,
            micro_batch_size=None,
            max_tokens_per_gpu=budget,
            use_dynamic_batch_size=True,
            num_micro_batches=int(reduced.item()),
        )
