"""Pack a micro-batch of documents (prompt + response) into one row of T tokens for varlen attention.

Loss masks are aligned to next-token logits: position t's logits predict token t + 1, so a
document's last position never carries loss (it would predict the next document). Padding sits at
the end, belongs to no document and has loss 0. Computing the logits is left to the backend.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

PAD_TOKEN_ID = 0


@dataclass
class PackedBatch:
    """Documents packed end to end into one row; T = padded total length."""

    input_ids: torch.Tensor
    """(1, T) long: the documents' tokens, then `PAD_TOKEN_ID` padding."""
    position_ids: torch.Tensor
    """(1, T) long: 0, 1, ... restarting at every document (and at the padding)."""
    cu_seqlens: torch.Tensor
    """(n + 1,) int32: document boundaries, cu_seqlens[i]:cu_seqlens[i + 1] is document i."""
    max_seqlen: int
    """Longest segment (document or trailing padding), the bound varlen kernels take."""
    loss_mask: torch.Tensor
    """(1, T) float: 1 where position t's logits predict a trainable response token t + 1."""
    response_slices: list[tuple[int, int]]
    """Per document, the [start, end) positions whose logits predict its response tokens."""

    @property
    def total_length(self) -> int:
        """T, the packed length including padding."""
        return self.input_ids.shape[1]

    @property
    def num_pad_tokens(self) -> int:
        return self.total_length - int(self.cu_seqlens[-1])

    @property
    def cu_seqlens_with_padding(self) -> torch.Tensor:
        """(n + 1,) or (n + 2,) int32: `cu_seqlens` plus the padding as its own final segment.

        Varlen kernels leave positions outside cu_seqlens unwritten; garbage there can be NaN, and
        NaN * 0 in a masked loss is still NaN. Passing this covers every position.
        """
        if self.num_pad_tokens == 0:
            return self.cu_seqlens
        end = torch.tensor([self.total_length], dtype=torch.int32)
        return torch.cat([self.cu_seqlens, end])


def _check_documents(
    token_lists: list[list[int]], response_lengths: list[int], loss_masks: list[list[int]]
) -> None:
    if not len(token_lists) == len(response_lengths) == len(loss_masks):
        raise ValueError(
            f"got {len(token_lists)} token lists, {len(response_lengths)} response lengths and "
            f"{len(loss_masks)} loss masks; pass one of each per document"
        )
    for i, (tokens, n_resp, mask) in enumerate(
        zip(token_lists, response_lengths, loss_masks, strict=True)
    ):
        if not 0 <= n_resp < len(tokens):
            raise ValueError(
                f"document {i}: response length {n_resp} must be in [0, {len(tokens)}) for "
                f"{len(tokens)} tokens; a document needs at least one prompt token, whose logits "
                "predict the first response token"
            )
        if len(mask) != n_resp:
            raise ValueError(
                f"document {i}: loss mask has {len(mask)} entries for {n_resp} response tokens; "
                "give one entry per response token"
            )


def pack_sequences(
    token_lists: list[list[int]],
    response_lengths: list[int],
    loss_masks: list[list[int]],
    pad_to_multiple: int = 1,
) -> PackedBatch:
    """Pack documents into one row, padded at the end to a multiple of `pad_to_multiple`.

    Document i's response is its last `response_lengths[i]` tokens; `loss_masks[i]` has one entry
    per response token. Response token j of a document at offset s with prompt length p sits at
    s + p + j and is predicted by the logits at s + p + j - 1, which is where its mask goes.
    """
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be at least 1, got {pad_to_multiple}")
    _check_documents(token_lists, response_lengths, loss_masks)
    lengths = [len(tokens) for tokens in token_lists]
    n_tokens = sum(lengths)
    total = -(-n_tokens // pad_to_multiple) * pad_to_multiple
    n_pad = total - n_tokens

    input_ids = torch.full((1, total), PAD_TOKEN_ID, dtype=torch.long)  # (1, T)
    input_ids[0, :n_tokens] = torch.tensor(list(itertools.chain(*token_lists)), dtype=torch.long)
    segments = [*lengths, n_pad] if n_pad else lengths
    position_ids = torch.cat(
        [torch.arange(n, dtype=torch.long) for n in segments] or [torch.zeros(0, dtype=torch.long)]
    ).unsqueeze(0)  # (1, T)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)  # (n + 1,)

    loss_mask = torch.zeros(1, total, dtype=torch.float32)  # (1, T)
    response_slices: list[tuple[int, int]] = []
    for start, length, n_resp, mask in zip(
        cu_seqlens[:-1].tolist(), lengths, response_lengths, loss_masks, strict=True
    ):
        end = start + length - 1  # the last position predicts across the boundary: excluded
        begin = end - n_resp
        loss_mask[0, begin:end] = torch.tensor(mask, dtype=torch.float32)
        response_slices.append((begin, end))

    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens,
        max_seqlen=max(segments, default=0),
        loss_mask=loss_mask,
        response_slices=response_slices,
    )


def unpack_per_token(values: torch.Tensor, packed: PackedBatch) -> list[torch.Tensor]:
    """Split per-position values (T,) or (1, T) into per-document (response_length,) tensors.

    Position t of `values` belongs to the logits at t (e.g. the log-prob of token t + 1), so the
    result for document i lines up with its response tokens and its loss-mask entries.
    """
    total = packed.total_length
    if values.dim() == 2 and values.shape[0] == 1:
        values = values[0]
    if values.dim() != 1 or values.shape[0] != total:
        raise ValueError(
            f"values must have shape (T,) or (1, T) with T={total} (the packed length), got "
            f"{tuple(values.shape)}"
        )
    return [values[begin:end] for begin, end in packed.response_slices]


def _segment_ids(cu_seqlens: torch.Tensor, total_length: int) -> torch.Tensor:
    """(T,) long: the document of each position; trailing padding gets id n (its own segment)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    n_docs = lengths.numel()
    ids = torch.repeat_interleave(torch.arange(n_docs), lengths)
    pad = torch.full((total_length - ids.numel(),), n_docs, dtype=torch.long)
    return torch.cat([ids, pad])


def attention_mask_from_cu_seqlens(cu_seqlens: torch.Tensor, total_length: int) -> torch.Tensor:
    """(T, T) bool, True where query q may attend to key k: same document and k <= q.

    Block-diagonal causal, for eager / SDPA attention where no varlen kernel keeps documents apart.
    Trailing padding forms one causal block of its own, so no row is empty (an all-masked row is
    NaN after softmax) and no document sees padding.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or int(cu_seqlens[0]) != 0:
        raise ValueError(
            f"cu_seqlens must be 1-D and start at 0, got {cu_seqlens.tolist()}; build it with "
            "pack_sequences"
        )
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()) or int(cu_seqlens[-1]) > total_length:
        raise ValueError(
            f"cu_seqlens {cu_seqlens.tolist()} must be non-decreasing and end at or before "
            f"total_length ({total_length})"
        )
    segment = _segment_ids(cu_seqlens, total_length)  # (T,)
    same_segment = segment[:, None] == segment[None, :]  # (T, T)
    causal = torch.ones(total_length, total_length, dtype=torch.bool).tril()  # (T, T)
    return same_segment & causal
