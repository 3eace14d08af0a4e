"""From a rollout's columnar batch to what one train step consumes: this rank's shard, its
micro-batches, and the packed tensors of one micro-batch.

Moving tensors to the device and computing logits are left to the backend.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from miles.backends.training_utils.batching.balance import get_seqlen_balanced_partitions
from miles.backends.training_utils.batching.micro_batch import (
    dynamic_micro_batches,
    fixed_micro_batches,
)
from miles.backends.training_utils.batching.packing import pack_sequences
from miles.backends.training_utils.batching.rollout_data import (
    RolloutBatch,
    batch_size,
    select_rows,
)


class DataIterator(Iterator[RolloutBatch]):
    """Yields `select_rows(batch, indices)` for each micro-batch's row indices, in order."""

    def __init__(self, batch: RolloutBatch, micro_batches: list[list[int]]) -> None:
        self.batch = batch
        self.micro_batches = micro_batches
        self._position = 0

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __iter__(self) -> DataIterator:
        return self

    def __next__(self) -> RolloutBatch:
        if self._position >= len(self.micro_batches):
            raise StopIteration
        indices = self.micro_batches[self._position]
        self._position += 1
        return select_rows(self.batch, indices)

    def reset(self) -> None:
        """Start again from the first micro-batch (e.g. the log-prob pass, then the train pass)."""
        self._position = 0

    def per_sample(self, per_micro_batch: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per-token results of each micro-batch ((sum R,) over its samples, in its order) as
        one (R,) tensor per sample of the batch, in the batch's order."""
        out: list[torch.Tensor | None] = [None] * sum(len(rows) for rows in self.micro_batches)
        for rows, results in zip(self.micro_batches, per_micro_batch, strict=True):
            lengths = [self.batch["response_lengths"][row] for row in rows]
            for row, piece in zip(rows, results.split(lengths), strict=True):
                out[row] = piece
        return out  # type: ignore[return-value]


def get_data_iterator(
    batch: RolloutBatch,
    *,
    micro_batch_size: int | None,
    max_tokens_per_gpu: int | None,
    use_dynamic_batch_size: bool,
    num_micro_batches: int | None = None,
) -> DataIterator:
    """Micro-batches over `batch`: by token budget (`total_lengths`) or by sample count.

    Pass exactly the setting the chosen mode uses and None for the other, so a setting that would
    be ignored is an error rather than a silent no-op (architecture.md: "Design rules"). `num_micro_batches` (dynamic
    only) forces that many micro-batches, e.g. the maximum over data-parallel ranks.
    """
    n = batch_size(batch)
    if use_dynamic_batch_size:
        if max_tokens_per_gpu is None or micro_batch_size is not None:
            raise ValueError(
                "--use-dynamic-batch-size packs micro-batches by --max-tokens-per-gpu: pass "
                f"max_tokens_per_gpu (got {max_tokens_per_gpu}) and micro_batch_size=None "
                f"(got {micro_batch_size}, which would be ignored)"
            )
        micro = dynamic_micro_batches(
            batch["total_lengths"], max_tokens_per_gpu, num_batches=num_micro_batches
        )
        return DataIterator(batch, micro)
    if micro_batch_size is None or max_tokens_per_gpu is not None or num_micro_batches is not None:
        raise ValueError(
            "without --use-dynamic-batch-size, micro-batches hold --micro-batch-size samples: pass "
            f"micro_batch_size (got {micro_batch_size}), and max_tokens_per_gpu=None (got "
            f"{max_tokens_per_gpu}) and num_micro_batches=None (got {num_micro_batches}), which "
            "would be ignored; or turn on --use-dynamic-batch-size"
        )
    return DataIterator(batch, fixed_micro_batches(n, micro_batch_size))


def _per_token_tensor(key: str, column: list, response_lengths: list[int]) -> torch.Tensor:
    pieces = [torch.as_tensor(row, dtype=torch.float32).reshape(-1) for row in column]
    for i, (piece, n_resp) in enumerate(zip(pieces, response_lengths, strict=True)):
        if piece.numel() != n_resp:
            raise ValueError(
                f"{key!r} row {i} has {piece.numel()} values for {n_resp} response tokens; "
                "per-token columns need one value per response token"
            )
    return torch.cat(pieces) if pieces else torch.zeros(0)


def _per_sample_tensor(column: list) -> torch.Tensor:
    if all(isinstance(v, int) and not isinstance(v, bool) for v in column):
        return torch.tensor(column, dtype=torch.long)
    return torch.tensor(column, dtype=torch.float32)


def token_rows(micro: RolloutBatch, key: str, dtype: torch.dtype) -> torch.Tensor:
    """A column of K values per response token (the teacher's top tokens, say) as a
    (sum of response lengths, K) tensor, samples concatenated in row order."""
    if key not in micro:
        raise KeyError(f"key {key!r} is not in the batch; it has {sorted(micro)}")
    pieces = [torch.as_tensor(row, dtype=dtype) for row in micro[key]]
    for i, (piece, n_resp) in enumerate(zip(pieces, micro["response_lengths"], strict=True)):
        if piece.dim() != 2 and not (n_resp == 0 and piece.numel() == 0):
            raise ValueError(f"{key!r} row {i} is not K values per response token")
        if piece.shape[0] != n_resp:
            raise ValueError(
                f"{key!r} row {i} has {piece.shape[0]} positions for {n_resp} response tokens"
            )
    widths = {piece.shape[1] for piece in pieces if piece.dim() == 2}
    if len(widths) > 1:
        raise ValueError(f"{key!r} rows have different K: {sorted(widths)}")
    width = widths.pop() if widths else 0
    return (
        torch.cat([piece.reshape(-1, width) for piece in pieces]) if pieces else torch.zeros(0, 0)
    )


def token_columns(micro: RolloutBatch, keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """Per-token columns of a micro-batch (one value per response token of every sample) as
    (sum of response lengths,) float32 tensors, samples concatenated in row order."""
    missing = [key for key in keys if key not in micro]
    if missing:
        raise KeyError(f"keys {missing} are not in the batch; it has {sorted(micro)}")
    lengths = micro["response_lengths"]
    return {key: _per_token_tensor(key, micro[key], lengths) for key in keys}


def get_batch(micro: RolloutBatch, keys: Sequence[str], pad_multiple: int = 1) -> dict[str, Any]:
    """Pack a micro-batch and turn the requested columns into tensors.

    Returns the `PackedBatch` fields (`input_ids`, `position_ids`, `cu_seqlens`, `max_seqlen`,
    `loss_mask`, `response_slices`), the `PackedBatch` itself as `packed`, `response_lengths`
    (B,), and for each key: per-token columns (a list per sample, e.g. `rollout_log_probs`,
    `advantages`) concatenated over samples into (sum of response lengths,) float32, in the order
    `unpack_per_token` produces; per-sample scalar columns as (B,).
    """
    if "loss_mask" in keys:
        # The column and the packed mask share the name; one would silently replace the other.
        raise ValueError(
            "get_batch always returns the packed 'loss_mask' (1, T); take the column's per-token "
            "values from token_columns(micro, ['loss_mask']) instead of asking for it as a key"
        )
    missing = [key for key in keys if key not in micro]
    if missing:
        raise KeyError(f"keys {missing} are not in the batch; it has {sorted(micro)}")
    response_lengths = micro["response_lengths"]
    packed = pack_sequences(micro["tokens"], response_lengths, micro["loss_mask"], pad_multiple)
    out: dict[str, Any] = {
        "packed": packed,
        "input_ids": packed.input_ids,
        "position_ids": packed.position_ids,
        "cu_seqlens": packed.cu_seqlens,
        "max_seqlen": packed.max_seqlen,
        "loss_mask": packed.loss_mask,
        "response_slices": packed.response_slices,
        "response_lengths": torch.tensor(response_lengths, dtype=torch.long),  # (B,)
    }
    for key in keys:
        column = micro[key]
        first = column[0] if column else None
        if isinstance(first, list | tuple) or (isinstance(first, torch.Tensor) and first.dim() > 0):
            out[key] = _per_token_tensor(key, column, response_lengths)  # (sum R,)
        else:
            out[key] = _per_sample_tensor(column)  # (B,)
    return out


def dp_partitions(total_lengths: Sequence[int], dp_size: int, balance: bool) -> list[list[int]]:
    """Row indices per data-parallel rank, the same number on every rank.

    Balanced: near-equal token totals (deterministic, so every rank computes the same split).
    Unbalanced: round-robin, rank r gets rows r, r + dp_size, ...
    """
    n = len(total_lengths)
    if dp_size < 1:
        raise ValueError(f"the data-parallel size must be at least 1, got {dp_size}")
    if n % dp_size:
        raise ValueError(
            f"the rollout has {n} samples, not divisible by the data-parallel size ({dp_size}); "
            f"make --rollout-batch-size x --n-samples-per-prompt a multiple of {dp_size}"
        )
    if balance:
        return get_seqlen_balanced_partitions(total_lengths, dp_size, equal_size=True)
    return [list(range(rank, n, dp_size)) for rank in range(dp_size)]


def get_rollout_data(
    batch: RolloutBatch, dp_rank: int, dp_size: int, balance: bool = True
) -> RolloutBatch:
    """This data-parallel rank's shard of a global batch; over all ranks, every row exactly once."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank ({dp_rank}) must be in [0, {dp_size}) for dp_size {dp_size}")
    batch_size(batch)  # fails early on ragged columns
    partitions = dp_partitions(batch["total_lengths"], dp_size, balance)
    return select_rows(batch, partitions[dp_rank])
