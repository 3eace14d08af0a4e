"""Routing replay over the FSDP backend's packed forwards (--use-rollout-routing-replay: R3,
--use-routing-replay: R2).

`packed_logits` runs a micro-batch's documents either as one packed row (`runs_as_one_row`: flash
attention, or a Gated DeltaNet hybrid) or as the rows of a right-padded batch (sdpa, eager); the
routers see those tokens flattened. Each
document's experts, (tokens - 1, layers, top_k) in the engine's `routed_experts` convention, are
placed where its tokens are in that order; the rest (padding, each document's last token) keep the
router's own choice. R3 replays the engine's experts in every policy forward. R2 records the
experts of the old-policy forward (`forward_log_probs`, every token) by sample index and replays
them in the optimizer steps that follow, so every step of a rollout routes alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import torch
from torch import Tensor, nn

from miles.backends.fsdp_utils.modeling import runs_as_one_row
from miles.backends.training_utils.batching.packing import PackedBatch
from miles.backends.training_utils.batching.rollout_data import RolloutBatch
from miles.backends.training_utils.step.routing_replay import RoutingReplay, decode_routed_experts

ReplayMode = Literal["rollout", "old_policy"]
Phase = Literal["old_policy", "train"]


def document_offsets(packed: PackedBatch, one_row: bool) -> tuple[list[int], int]:
    """Where each document's first token is in the routers' flattened token order, and how many
    tokens that order has; `one_row`: the forward runs the packed row as one sequence
    (`modeling.runs_as_one_row`), else one padded row per document."""
    lengths = packed.cu_seqlens.diff().tolist()
    if one_row:
        return [int(start) for start in packed.cu_seqlens[:-1]], packed.total_length
    longest = max(lengths)
    return [row * longest for row in range(len(lengths))], len(lengths) * longest


def real_tokens(packed: PackedBatch, one_row: bool) -> Tensor:
    """(tokens,) bool over the routers' flattened token order (see `document_offsets`): True for
    document tokens, False for padding."""
    offsets, total = document_offsets(packed, one_row)
    real = torch.zeros(total, dtype=torch.bool)
    for offset, length in zip(offsets, packed.cu_seqlens.diff().tolist(), strict=True):
        real[offset : offset + length] = True
    return real


class PackedRouting:
    """Which experts the policy's forwards use, per micro-batch."""

    def __init__(self, model: nn.Module, mode: ReplayMode, attn_implementation: str) -> None:
        self.replay = RoutingReplay(model)
        self.mode = mode
        self.one_row = runs_as_one_row(model, attn_implementation)
        self.recorded: dict[int, Tensor] = {}
        """R2: sample index -> the experts of its old-policy forward (tokens - 1, layers, top_k)."""

    def start_old_policy_pass(self) -> None:
        """A new rollout's old-policy forwards begin: forget the previous rollout's routing."""
        if self.mode == "old_policy":
            self.recorded = {}

    @contextlib.contextmanager
    def around(self, micro: RolloutBatch, packed: PackedBatch, phase: Phase) -> Iterator[None]:
        """The routing of one policy forward over `micro` packed as `packed`."""
        lengths = packed.cu_seqlens.diff().tolist()
        offsets, total = document_offsets(packed, self.one_row)
        if self.mode == "old_policy" and "sample_indices" not in micro:
            raise ValueError(
                "--use-routing-replay keeps each sample's old-policy routing by its index, but "
                "the batch has no 'sample_indices' (samples_to_rollout_batch writes them)"
            )
        if self.mode == "old_policy" and phase == "old_policy":
            with self.replay.recording() as recorded:
                yield
            (flat,) = recorded
            for index, offset, length in zip(
                micro["sample_indices"], offsets, lengths, strict=True
            ):
                self.recorded[int(index)] = flat[offset : offset + length].cpu()
            return
        per_document = self._given(micro, lengths)
        if per_document is None:
            yield
            return
        flat = torch.full((total, self.replay.num_layers, self.replay.top_k), -1, dtype=torch.long)
        for experts, offset, length in zip(per_document, offsets, lengths, strict=True):
            # The engine reports every token but the last; R2 recorded them all.
            if experts.shape[0] not in (length - 1, length):
                raise ValueError(
                    f"a sample of {length} tokens came with experts for {experts.shape[0]}; the "
                    f"engine reports {length - 1} (every token but the last)"
                )
            flat[offset : offset + experts.shape[0]] = experts
        with self.replay.replaying(flat):
            yield

    def _given(self, micro: RolloutBatch, lengths: list[int]) -> list[Tensor] | None:
        if self.mode == "rollout":
            if "routed_experts" not in micro:
                raise ValueError(
                    "--use-rollout-routing-replay trains with the engine's experts, but the batch "
                    "has no 'routed_experts': the rollout asks the engines for them "
                    "(return_routed_experts); a custom path must keep Sample.routed_experts"
                )
            layers, top_k = self.replay.num_layers, self.replay.top_k
            return [decode_routed_experts(e, layers, top_k) for e in micro["routed_experts"]]
        missing = [i for i in micro["sample_indices"] if int(i) not in self.recorded]
        if missing:
            raise ValueError(
                f"--use-routing-replay replays the old-policy forward's experts, but samples "
                f"{missing[:8]} had none: use a loss that computes old log-probs (e.g. ppo / grpo "
                "with --eps-clip), or --use-rollout-routing-replay"
            )
        return [self.recorded[int(i)] for i in micro["sample_indices"]]
