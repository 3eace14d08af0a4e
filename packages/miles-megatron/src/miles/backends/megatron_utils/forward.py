"""One micro-batch through a Megatron GPTModel: padded inputs, log-probs of the response tokens, loss.

Samples of a micro-batch are right-padded to a common length; with causal attention a padded
position never influences an earlier one, so no sample sees another's tokens or its own padding.
The vocab-parallel logits are gathered over the tensor-parallel group before the log-softmax (simple
and exact; a vocab-parallel log-softmax would save that memory). Megatron's schedule divides each
micro-batch's loss by the number of micro-batches; training-utils' loss is already normalized by
global counts, so the loss handed to the schedule is multiplied back.

With context parallelism each rank runs its slice of every sequence (`context_parallel`): it takes
the log-probs of its own positions and all-gathers them (B x T floats, not logits), so every
context-parallel rank computes the whole micro-batch's loss, and the gather's backward hands each
rank the gradient of its positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from miles.backends.megatron_utils.context_parallel import (
    gather_sequence,
    local_positions,
    split_sequence,
)
from miles.backends.training_utils.data import get_batch
from miles.backends.training_utils.log_utils import aggregate_train_losses, log_train_step
from miles.backends.training_utils.logprobs import get_log_probs_and_entropy
from miles.backends.training_utils.loss import LossNormalizer, loss_function
from miles.backends.training_utils.loss_config import LossConfig
from miles.backends.training_utils.rollout_data import RolloutBatch


def pad_micro_batch(
    micro: RolloutBatch, *, multiple_of: int = 1
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """input_ids (B, T) right-padded with 0, position_ids (B, T), and per sample the positions
    whose logits predict its response tokens and those target tokens."""
    lengths = list(micro["total_lengths"])
    width = -(-max(lengths) // multiple_of) * multiple_of
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)  # (B, T)
    positions, targets = [], []
    for row, (tokens, response_length) in enumerate(
        zip(micro["tokens"], micro["response_lengths"], strict=True)
    ):
        input_ids[row, : len(tokens)] = torch.as_tensor(tokens)
        start = len(tokens) - response_length
        positions.append(torch.arange(start - 1, len(tokens) - 1))  # (R,)
        targets.append(torch.as_tensor(tokens[start:], dtype=torch.long))  # (R,)
    position_ids = torch.arange(width).expand(len(lengths), width)  # (B, T)
    return input_ids, position_ids, positions, targets


class MicroBatchForward:
    """Builds the forward-step function Megatron's pipeline schedules call per micro-batch."""

    def __init__(
        self, *, hf_config: Any, temperature: float, device: torch.device, cp_group: Any = None
    ):
        self.vocab_size = hf_config.vocab_size
        self.temperature = temperature
        self.device = device
        self.cp_group = cp_group
        self.cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
        self.cp_rank = dist.get_rank(cp_group) if cp_group is not None else 0

    def normalizer(
        self, step_batch: RolloutBatch, *, global_batch_size: int, dp_size: int, dp_group: Any
    ) -> LossNormalizer:
        local = float(sum(sum(mask) for mask in step_batch["loss_masks"]))
        total = torch.tensor([local], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=dp_group)
        return LossNormalizer(
            num_samples=global_batch_size, num_tokens=int(total.item()), dp_size=dp_size
        )

    def step_func(
        self,
        loss_config: LossConfig,
        *,
        forward_only: bool,
        collect: str,
        num_micro_batches: int,
        normalizer: LossNormalizer | None = None,
    ) -> Callable:
        """`forward_step(data_iterator, model)` for Megatron's schedules; `collect` is
        "log_probs" (forward only: per-sample log-probs) or "loss" (training)."""

        def forward_step(data_iterator, model):
            micro = next(data_iterator)
            input_ids, position_ids, positions, targets = pad_micro_batch(
                micro, multiple_of=2 * self.cp_size if self.cp_size > 1 else 1
            )
            model_ids, model_positions = input_ids, position_ids
            if self.cp_size > 1:
                model_ids = split_sequence(input_ids, 1, self.cp_rank, self.cp_size)
                model_positions = split_sequence(position_ids, 1, self.cp_rank, self.cp_size)
            output = model(
                input_ids=model_ids.to(self.device),
                position_ids=model_positions.to(self.device),
                attention_mask=None,  # causal: right padding never reaches an earlier position
            )

            def loss_func(output_tensor: torch.Tensor):
                if self.cp_size > 1:
                    log_probs, entropy = self._split_response_log_probs(
                        output_tensor, input_ids, positions
                    )
                else:
                    log_probs, entropy = self._response_log_probs(output_tensor, positions, targets)
                if collect == "log_probs":
                    pieces = [p.detach().float().cpu() for p in log_probs]
                    return output_tensor.sum() * 0.0, {"log_probs": pieces}
                assert normalizer is not None, "training needs the global-batch normalizer"
                loss, metrics = loss_function(
                    self._loss_inputs(micro, log_probs, entropy, loss_config),
                    loss_config,
                    normalizer,
                )
                # Megatron multiplies a loss by the context-parallel size, expecting each rank's
                # share of it; every context-parallel rank here holds the whole loss.
                return loss * num_micro_batches / self.cp_size, {"metrics": metrics}

            return output, loss_func

        return forward_step

    def _response_log_probs(
        self,
        logits: torch.Tensor,
        positions: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        full = gather_from_tensor_model_parallel_region(logits)[..., : self.vocab_size]  # (B, T, V)
        log_probs, entropies = [], []
        for row, (pos, tgt) in enumerate(zip(positions, targets, strict=True)):
            lp, ent = get_log_probs_and_entropy(
                full[row, pos.to(full.device)],
                tgt.to(full.device),
                temperature=self.temperature,
            )
            log_probs.append(lp)
            entropies.append(ent)
        return log_probs, entropies

    def _split_response_log_probs(
        self, logits: torch.Tensor, input_ids: torch.Tensor, positions: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`_response_log_probs` when `logits` [B, T / cp, V / tp] cover this context-parallel
        rank's slice of the padded `input_ids` [B, T]: log-probs of every local position's next
        token, gathered over the context-parallel group, then each sample's response picked."""
        full = gather_from_tensor_model_parallel_region(logits)[..., : self.vocab_size]
        rows, length = input_ids.shape
        here = local_positions(length, self.cp_rank, self.cp_size)
        next_ids = input_ids[:, (here + 1).clamp(max=length - 1)]  # (B, T / cp); last: padding
        log_probs, entropy = get_log_probs_and_entropy(
            full.reshape(-1, full.size(-1)),
            next_ids.reshape(-1).to(full.device),
            temperature=self.temperature,
        )
        log_probs = gather_sequence(log_probs.view(rows, -1), 1, self.cp_group)  # (B, T)
        entropy = gather_sequence(entropy.view(rows, -1), 1, self.cp_group)
        picked = [pos.to(full.device) for pos in positions]
        return (
            [log_probs[row, pos] for row, pos in enumerate(picked)],
            [entropy[row, pos] for row, pos in enumerate(picked)],
        )

    def _loss_inputs(
        self, micro: RolloutBatch, log_probs: list, entropy: list, loss_config: LossConfig
    ) -> dict[str, Any]:
        keys = ["loss_masks"]
        if loss_config.loss_type != "sft_loss":
            keys += ["log_probs", "advantages"]
            if loss_config.use_kl_loss:
                keys.append("ref_log_probs")
            if loss_config.off_policy_correction is not None:
                keys.append("rollout_log_probs")
        tensors = get_batch(micro, keys)
        inputs = {
            "log_probs": torch.cat(log_probs),
            "entropy": torch.cat(entropy),
            "loss_mask": tensors["loss_masks"].to(self.device),
            "response_lengths": micro["response_lengths"],
        }
        for key in keys[1:]:
            inputs["old_log_probs" if key == "log_probs" else key] = tensors[key].to(self.device)
        return inputs

    def step_metrics(
        self, losses: list[dict], *, group: Any, step: int, lr: float, grad_norm: float
    ) -> dict[str, float]:
        """One optimizer step's metrics from the schedule's per-micro-batch outputs (which only
        the last pipeline stage has; the other stages report step, lr and grad norm)."""
        pairs = [item["metrics"] for item in losses if "metrics" in item]
        metrics = aggregate_train_losses(pairs, group=group) if pairs else {}
        return log_train_step(metrics, step=step, lr=lr, grad_norm=grad_norm)
