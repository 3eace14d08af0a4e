"""One micro-batch through a Megatron GPTModel: padded inputs, log-probs of the response tokens, loss.

Samples of a micro-batch are right-padded to a common length; with causal attention a padded
position never influences an earlier one, so no sample sees another's tokens or its own padding.
The vocab-parallel logits are gathered over the tensor-parallel group before the log-softmax (simple
and exact; a vocab-parallel log-softmax would save that memory). Megatron's schedule divides each
micro-batch's loss by the number of micro-batches; the train step's loss is already normalized by
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
from miles.backends.training_utils.batching.rollout_data import RolloutBatch
from miles.backends.training_utils.batching.train_batches import token_rows
from miles.backends.training_utils.step.logprobs import get_log_probs_and_entropy
from miles.backends.training_utils.step.train_engine import SCORED_TOKEN_IDS, MicroBatchLoss


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


def scored_ids(micro: RolloutBatch) -> list[torch.Tensor] | None:
    """Per sample the (R, K) token ids whose log-probs the loss also reads at each response
    position (`SCORED_TOKEN_IDS`); None when the micro-batch has none."""
    if SCORED_TOKEN_IDS not in micro:
        return None
    rows = token_rows(micro, SCORED_TOKEN_IDS, torch.long)  # (sum R, K)
    return list(rows.split(list(micro["response_lengths"])))


class MicroBatchForward:
    """Builds the forward-step function Megatron's pipeline schedules call per micro-batch.
    What the loss reads of the model's output is `response_outputs`: the policy's log-probs
    here, the values of PPO's value model in `value_model.ValueForward`."""

    def __init__(
        self, *, hf_config: Any, temperature: float, device: torch.device, cp_group: Any = None
    ):
        self.vocab_size = hf_config.vocab_size
        self.temperature = temperature
        self.device = device
        self.cp_group = cp_group
        self.cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
        self.cp_rank = dist.get_rank(cp_group) if cp_group is not None else 0

    def step_func(self, *, num_micro_batches: int, loss_fn: MicroBatchLoss | None) -> Callable:
        """`forward_step(data_iterator, model)` for Megatron's schedules over an iterator of
        (index, micro-batch). Without `loss_fn` (forward only) each micro-batch yields its
        response log-probs; with it, the loss `loss_fn` forms and its metric pairs."""

        def forward_step(data_iterator, model):
            index, micro = next(data_iterator)
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
                response, entropy, extra = self.response_outputs(
                    output_tensor, micro, input_ids, positions, targets
                )
                if loss_fn is None:
                    pieces = response.detach().float().cpu()  # (sum R,)
                    return output_tensor.sum() * 0.0, {"log_probs": pieces}
                loss, metrics = loss_fn(index, response, entropy, extra)
                # Megatron's schedule divides a loss by the number of micro-batches and
                # multiplies it by the context-parallel size, expecting each rank's share; the
                # step's loss is already normalized by global counts, and every
                # context-parallel rank here holds the whole of it.
                return loss * num_micro_batches / self.cp_size, {"metrics": metrics}

            return output, loss_func

        return forward_step

    def response_outputs(
        self,
        output: torch.Tensor,
        micro: RolloutBatch,
        input_ids: torch.Tensor,
        positions: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What the loss reads of the model's `output` for `micro` (padded to `input_ids`, with
        `pad_micro_batch`'s response positions and targets): the (sum R,) response log-probs,
        their entropies, and the (sum R, K) log-probs of its scored ids (None without them)."""
        # Each response position's target, then the K token ids it also scores, if any.
        scored = scored_ids(micro)
        if scored is not None:
            targets = [
                torch.cat([t.unsqueeze(-1), ids], dim=-1)
                for t, ids in zip(targets, scored, strict=True)
            ]  # (R, 1 + K) per sample
        if self.cp_size > 1:
            log_probs, entropy = self._split_response_log_probs(
                output, input_ids, positions, targets
            )
        else:
            log_probs, entropy = self._response_log_probs(output, positions, targets)
        both = torch.cat(log_probs)  # (sum R,) or (sum R, 1 + K)
        if scored is None:
            return both, torch.cat(entropy), None
        return both[:, 0], torch.cat(entropy), both[:, 1:]

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
        self,
        logits: torch.Tensor,
        input_ids: torch.Tensor,
        positions: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`_response_log_probs` when `logits` [B, T / cp, V / tp] cover this context-parallel
        rank's slice of the padded `input_ids` [B, T]: log-probs of every local position's next
        token (and of the K token ids `targets` also score there), gathered over the
        context-parallel group, then each sample's response picked."""
        full = gather_from_tensor_model_parallel_region(logits)[..., : self.vocab_size]
        rows, length = input_ids.shape
        here = local_positions(length, self.cp_rank, self.cp_size)
        # Every position's next token (the last one's: padding), then at response positions the
        # K ids also scored there, if any (the next token again elsewhere, where nothing reads).
        ids = input_ids[:, (torch.arange(length) + 1).clamp(max=length - 1)]  # (B, T)
        if targets and targets[0].dim() == 2:
            ids = ids.unsqueeze(-1).repeat(1, 1, targets[0].shape[1])  # (B, T, 1 + K)
            for row, (pos, tgt) in enumerate(zip(positions, targets, strict=True)):
                ids[row, pos] = tgt
        next_ids = ids[:, here]  # (B, T / cp) or (B, T / cp, 1 + K)
        log_probs, entropy = get_log_probs_and_entropy(
            full.reshape(-1, full.size(-1)),
            next_ids.reshape(rows * here.numel(), -1).squeeze(-1).to(full.device),
            temperature=self.temperature,
        )
        log_probs = gather_sequence(log_probs.view(rows, here.numel(), -1), 1, self.cp_group)
        log_probs = log_probs.squeeze(-1)  # (B, T) or (B, T, 1 + K)
        entropy = gather_sequence(entropy.view(rows, -1), 1, self.cp_group)
        picked = [pos.to(full.device) for pos in positions]
        return (
            [log_probs[row, pos] for row, pos in enumerate(picked)],
            [entropy[row, pos] for row, pos in enumerate(picked)],
        )
