"""The columnar train data of one rollout and the row selections done on it.

(architecture.md: "Contracts / Data")

A `RolloutBatch` is a plain dict of equal-length per-sample lists, so it pickles cheaply into the
Ray object store and a data-parallel shard is just a row selection. Tensors are made later, per
micro-batch (`data.get_batch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

from miles.backends.training_utils.batching.sample import Sample

if TYPE_CHECKING:
    from torch import Tensor


class _RequiredColumns(TypedDict):
    """The columns every batch has (`samples_to_rollout_batch` makes them)."""

    tokens: list[list[int]]
    """Prompt then response token ids."""
    response_lengths: list[int]
    """Number of response tokens, the trailing part of `tokens`."""
    total_lengths: list[int]
    """len(tokens): what micro-batching and DP balancing weigh."""
    loss_mask: list[list[int]]
    """One entry per response token, 1 where the token is trained on (all ones when unset)."""
    rewards: list[float]
    """The normalized reward training uses (e.g. group-normalized)."""
    raw_reward: list[float]
    """The reward function's output, for logging."""
    sample_indices: list[int]
    """`Sample.index`, to map rows back to samples."""
    weight_versions: list[int | None]
    """The engine weight version that generated the sample."""


class RolloutBatch(_RequiredColumns, total=False):
    """Per-sample columns; row i of every column describes the same sample.

    Every batch has the columns of `_RequiredColumns`; those declared here exist only sometimes.
    A plain dict at run time: the `TypedDict` only names and types the columns. A column the loss
    reads (`registry.BatchInput`) has the name of that loss input, from the rollout to the loss.
    """

    rollout_log_probs: list[list[float]]
    """The engine's log-prob of each response token; only when every sample has them."""
    teacher_log_probs: list[list[float]]
    """The teacher's log-prob of each response token (--use-opd); only when every sample has
    them."""
    teacher_top_ids: list[list[list[int]]]
    """The teacher's top K token ids at each response position (--opd-kl-mode topk); only when
    every sample has them."""
    teacher_top_log_probs: list[list[list[float]]]
    """The teacher's log-probs of `teacher_top_ids`, K per response token; only when every sample
    has them."""
    images: list[list[str]]
    """Each sample's images (`Sample.images`, [] for a text-only sample); only when some sample
    of the batch has images."""
    routed_experts: list[str]
    """The engine's MoE routing (base64, SGLang's encoding); only when every sample has it
    (--use-rollout-routing-replay)."""
    old_log_probs: list[Tensor]
    """Added by the train step: the policy's log-probs before this rollout's first optimizer
    step (the engine's with --use-rollout-logprobs), one per response token."""
    ref_log_probs: list[Tensor]
    """Added by the train step: the frozen reference model's log-probs, one per response token."""
    advantages: list[Tensor]
    """Added by the train step: the estimator's advantage of each response token."""
    returns: list[Tensor]
    """Added by the train step with `advantages`: the estimator's return of each response token."""
    values: list[Tensor]
    """A critic's value of each response token (ppo)."""


ROLLOUT_BATCH_KEYS: tuple[str, ...] = (
    "tokens",
    "response_lengths",
    "total_lengths",
    "loss_mask",
    "rewards",
    "raw_reward",
    "rollout_log_probs",
    "teacher_log_probs",
    "teacher_top_ids",
    "teacher_top_log_probs",
    "images",
    "routed_experts",
    "sample_indices",
    "weight_versions",
)
"""Keys `samples_to_rollout_batch` may produce (`rollout_log_probs` and `teacher_log_probs` only
when all samples have them)."""


def batch_size(batch: RolloutBatch) -> int:
    """Number of samples (rows) in `batch`; every column must have that many entries."""
    lengths = {key: len(column) for key, column in batch.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(
            f"every column of a RolloutBatch must have one entry per sample, got lengths {lengths}"
        )
    return next(iter(lengths.values()), 0)


def samples_to_rollout_batch(samples: list[Sample], rewards: list[float]) -> RolloutBatch:
    """Turn samples into columns; `rewards[i]` is the normalized reward of `samples[i]`."""
    if len(rewards) != len(samples):
        raise ValueError(
            f"got {len(rewards)} rewards for {len(samples)} samples; pass one normalized reward "
            "per sample, in the same order"
        )
    for position, sample in enumerate(samples):
        sample.validate()
        if sample.index is None:
            raise ValueError(
                f"samples[{position}] has no index; set Sample.index (unique within the rollout) "
                "before building the train batch"
            )
        if sample.reward is None and sample.raw_reward is None:
            raise ValueError(
                f"sample {sample.index} has no reward; score every sample (reward or raw_reward) "
                "before building the train batch"
            )

    batch: RolloutBatch = {
        "tokens": [list(s.tokens) for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "total_lengths": [len(s.tokens) for s in samples],
        "loss_mask": [s.effective_loss_mask for s in samples],
        "rewards": [float(r) for r in rewards],
        "raw_reward": [_raw_reward(s) for s in samples],
        "sample_indices": [s.index for s in samples],
        "weight_versions": [s.weight_version for s in samples],
    }
    for column, hint in (
        (
            "rollout_log_probs",
            "request log-probs (return_logprob) for every generation or for none",
        ),
        ("teacher_log_probs", "score every sample with the teacher (--use-opd) or none"),
        ("teacher_top_ids", "score every sample's top tokens with the teacher or none"),
        ("teacher_top_log_probs", "score every sample's top tokens with the teacher or none"),
        (
            "routed_experts",
            "ask every generation for its routed experts (return_routed_experts) or none",
        ),
    ):
        values = [getattr(s, column) for s in samples]
        if samples and all(v is not None for v in values):
            batch[column] = [v if isinstance(v, str) else _copy(v) for v in values]
        elif any(v is not None for v in values):
            missing = [s.index for s, v in zip(samples, values, strict=True) if v is None]
            raise ValueError(f"samples {missing[:8]} have no {column} while others do; {hint}")
    if any(s.images for s in samples):  # a mixed batch: text-only samples have none
        batch["images"] = [list(s.images or ()) for s in samples]
    return batch


def _copy(values: list) -> list:
    """A copy of a per-token list, rows of lists (the teacher's top tokens) copied too."""
    return [list(v) if isinstance(v, list | tuple) else v for v in values]


def _raw_reward(sample: Sample) -> float:
    value = sample.raw_reward if sample.raw_reward is not None else sample.reward
    assert value is not None, "checked by samples_to_rollout_batch"
    return float(value)


def select_rows(batch: RolloutBatch, indices: Sequence[int]) -> RolloutBatch:
    """A new batch holding rows `indices` of `batch`, in that order (columns are new lists)."""
    n = batch_size(batch)
    bad = [i for i in indices if not 0 <= i < n]
    if bad:
        raise IndexError(f"row indices {bad[:8]} are out of range for a batch of {n} samples")
    return {key: [column[i] for i in indices] for key, column in batch.items()}


def split_rollout_batch_by_dp(
    batch: RolloutBatch, dp_size: int, partitions: list[list[int]]
) -> list[RolloutBatch]:
    """One batch per data-parallel rank: rank r gets rows `partitions[r]`.

    The partitions must cover every row exactly once, so no sample is trained twice or dropped.
    """
    if len(partitions) != dp_size:
        raise ValueError(
            f"got {len(partitions)} partitions for a data-parallel size of {dp_size}; pass one "
            "list of row indices per rank"
        )
    n = batch_size(batch)
    covered = sorted(i for part in partitions for i in part)
    if covered != list(range(n)):
        raise ValueError(
            f"partitions must cover rows 0..{n - 1} exactly once each; got {len(covered)} indices "
            f"({len(set(covered))} distinct) for {n} rows"
        )
    return [select_rows(batch, part) for part in partitions]
