"""`TrainEngine`: the few primitives a training backend supplies; the RL step is written once on top.

The step (`trainer.PolicyTrainer`) decides what to compute and in which order; an engine only runs
micro-batches through its model. Engines own their forward/backward loop, so a schedule-driven
backend (Megatron's pipeline schedules interleave forwards and backwards of several micro-batches)
plugs in the same way as a plain loop (FSDP): the step hands over the whole list of micro-batches
and a loss callback, and the engine calls the callback wherever its schedule computes a loss.

Every method is called on every rank of the training group, in the same order (most are
collectives). Results come back on every rank, also where a pipeline stage computed no loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from miles.backends.training_utils.batching.rollout_data import RolloutBatch

MicroBatchLoss = Callable[[int, Tensor, Tensor, Tensor | None], tuple[Tensor, dict[str, Tensor]]]
"""(micro-batch index, log_probs (sum R,), entropy (sum R,), scored (sum R, K) or None) ->
(loss, metric pairs).

`log_probs` and `entropy` cover the micro-batch's response tokens, samples concatenated, with
gradients. When the micro-batch holds the column `SCORED_TOKEN_IDS` (K token ids per response
token), `scored` is the log-probs of those ids at each response position, under the same
distribution and with gradients; else None. The engine backpropagates `loss` as it is (plus
whatever scaling its own schedule needs, which it undoes itself)."""

SCORED_TOKEN_IDS = "teacher_top_ids"
"""The micro-batch column of token ids (per sample (R, K)) whose log-probs an engine also
computes at every response position: the teacher's top tokens of --opd-kl-mode topk."""


@dataclass(frozen=True, kw_only=True)
class OptimizerStepResult:
    """What one optimizer step reports (the same on every rank)."""

    grad_norm: float
    """Norm of the full gradient before clipping."""
    lr: float
    """Learning rate the step used."""
    applied: bool
    """False when the step was skipped (a non-finite gradient norm)."""


@dataclass(frozen=True, kw_only=True)
class LoadedCheckpoint:
    """A checkpoint an engine restored: the rollout it ended and what the saver put beside it."""

    rollout_id: int
    extra: dict[str, Any]


@runtime_checkable
class TrainEngine(Protocol):
    """One rank of a training backend, as the RL step sees it."""

    dp_group: Any
    """Process group over the data-parallel replicas (ranks holding different samples); None
    when this rank is the only replica."""
    dp_size: int
    """Number of data-parallel replicas."""
    dp_rank: int
    """Which replica this rank belongs to: the rollout shard it trains on."""
    context_parallel_size: int
    """Ranks one sequence is split over: a micro-batch may hold this many times
    --max-tokens-per-gpu tokens."""
    engine_dtype: torch.dtype
    """dtype in which the weights go to the rollout engines and into HF exports."""

    def forward_log_probs(
        self, micro_batches: Sequence[RolloutBatch], *, reference: bool = False
    ) -> list[Tensor]:
        """Without gradients: per micro-batch, the (sum R,) float32 CPU log-probs of its response
        tokens under the policy (or the frozen reference model)."""
        ...

    def forward_backward(
        self, micro_batches: Sequence[RolloutBatch], loss_fn: MicroBatchLoss
    ) -> list[dict[str, Tensor]]:
        """Forward every micro-batch with gradients, call `loss_fn` on each and accumulate the
        gradients of its loss; returns each micro-batch's metric pairs, in order."""
        ...

    def zero_grad(self) -> None:
        """Drop the accumulated gradients."""
        ...

    def update_reference(self) -> None:
        """Set the frozen reference model's weights to the policy's, an exact copy
        (--ref-update-interval); only called on an engine built with a reference model."""
        ...

    def optimizer_step(self) -> OptimizerStepResult:
        """Clip by the full gradient norm, step the optimizer and the learning-rate schedule."""
        ...

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(Hugging Face name, full tensor in `engine_dtype`) pairs for weight sync; a collective
        where the weights are sharded, so every rank drains it."""
        ...

    def weights_on_device(self) -> contextlib.AbstractContextManager[None]:
        """Keeps the weights readable for a weight push while the engine sleeps (a no-op where
        sleeping leaves them readable)."""
        ...

    def save(
        self, directory: str, rollout_id: int, extra: dict[str, Any], *, commit: bool = True
    ) -> None:
        """A resumable checkpoint of rollout `rollout_id`. `commit` writes the latest pointer
        last; without it the caller commits once its own parts of the rollout are written
        (`miles.utils.checkpoint_layout.commit_checkpoint`)."""
        ...

    def load(self, directory: str) -> LoadedCheckpoint | None:
        """Restore the latest complete checkpoint in `directory`; None when there is none."""
        ...

    def export_hf(self, path: str | Path) -> None:
        """The current weights as a Hugging Face checkpoint directory."""
        ...

    def sleep(self) -> None:
        """Free device memory: the training state waits in host memory."""
        ...

    def wake_up(self) -> None:
        """Bring back what `sleep` moved."""
        ...


@runtime_checkable
class TrainsAdapters(Protocol):
    """An engine whose policy is a frozen base plus LoRA adapters, which it can hand over as a
    PEFT adapter (--lora-sync adapter: the rollout engines load it beside the base)."""

    def adapter_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(PEFT name, full tensor) of every adapter matrix, the keys of an
        adapter_model.safetensors; a collective where sharded, so every rank drains it."""
        ...

    def adapter_config(self) -> dict[str, Any]:
        """The adapter's adapter_config.json."""
        ...


def paired_reference_parameters(
    policy: dict[str, Tensor], reference: dict[str, Tensor], *, ref_checkpoint: str, checkpoint: str
) -> list[tuple[Tensor, Tensor]]:
    """(policy, reference) parameter pairs by name, for `update_reference`; refused when the
    reference model (--ref-load `ref_checkpoint`) is another architecture than the policy's."""
    if policy.keys() != reference.keys() or any(
        policy[name].shape != ref.shape for name, ref in reference.items()
    ):
        raise ValueError(
            f"--ref-update-interval copies the policy into the reference model, but the "
            f"reference (--ref-load {ref_checkpoint}) has another architecture than the "
            f"policy ({checkpoint}); drop one of the two flags"
        )
    return [(policy[name], ref) for name, ref in reference.items()]
