"""The running batch's KV cache: one left-padded (B, kv_heads, L, head_dim) tensor per layer and a
(B, L) mask of real positions, grown in place by decode steps, joined and split by rows.

Requests join between decode steps (their prefill cache is padded to the batch's length and
concatenated) and leave the same way (their rows are dropped and all-padding columns trimmed),
which is what makes the batching continuous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class BatchState:
    """KV tensors per layer, (B, H, L, D), the (B, L) mask of real (1) vs padding (0), the LoRA
    adapter each row's KV was computed with (`lora_layers.LoraAdapter`; None: the base model),
    and a vision-language model's rope deltas. Both travel with the rows: a decode step must run
    each row with the adapter its cache came from, at the position its prompt's images left."""

    keys: list[Tensor]
    values: list[Tensor]
    mask: Tensor
    adapters: list[Any] | None = None
    """One per row, or None when every row runs the base model."""
    rope_deltas: Tensor | None = None
    """(B,) for a model with multimodal rotary positions (mrope): each row's next position is its
    real-token count plus its delta (negative after images, whose tokens share positions). None
    for a text model, whose next position is the real-token count."""

    @property
    def size(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        return self.mask.shape[1]


def _left_pad(t: Tensor, target: int, dim: int) -> Tensor:
    missing = target - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def append_kv(cached: Tensor, new: Tensor) -> Tensor:
    """`cached` (B, H, L, D) followed by `new` (B, H, n, D) along the sequence.

    Written in place when `cached` is the front of a buffer with room (its strides say how much:
    a buffer of C positions has stride C * D on the head dim), else into a new buffer with room
    for the next steps: a decode step then copies one token per row, not the whole cache.
    """
    batch, heads, length, dim = cached.shape
    grown = length + new.shape[2]
    capacity = cached.stride(1) // dim if cached.stride(2) == dim and cached.stride(3) == 1 else 0
    if not (
        capacity >= grown
        and cached.stride(0) == heads * capacity * dim
        and cached.storage_offset() == 0
    ):
        room = max(_MIN_ROOM, length // 2)  # amortized: one whole copy per length/2 steps
        buffer = cached.new_empty(batch, heads, grown + room, dim)
        buffer[:, :, :length] = cached
        cached = buffer[:, :, :length]
    out = cached.as_strided((batch, heads, grown, dim), cached.stride())
    out[:, :, length:] = new
    return out


# Positions a grown KV buffer keeps free at least (a few decode steps' worth).
_MIN_ROOM = 32


def merge_states(a: BatchState | None, b: BatchState) -> BatchState:
    """Rows of `a` followed by rows of `b`, both left-padded to the longer length."""
    if a is None or a.size == 0:
        return b
    length = max(a.length, b.length)
    keys = [
        torch.cat([_left_pad(x, length, 2), _left_pad(y, length, 2)])
        for x, y in zip(a.keys, b.keys, strict=True)
    ]
    values = [
        torch.cat([_left_pad(x, length, 2), _left_pad(y, length, 2)])
        for x, y in zip(a.values, b.values, strict=True)
    ]
    mask = torch.cat([_left_pad(a.mask, length, 1), _left_pad(b.mask, length, 1)])
    adapters = None
    if a.adapters is not None or b.adapters is not None:
        adapters = row_adapters(a) + row_adapters(b)
    deltas = None
    if a.rope_deltas is not None or b.rope_deltas is not None:
        deltas = torch.cat([_row_deltas(a), _row_deltas(b)])
    return BatchState(keys, values, mask, adapters, deltas)


def _row_deltas(state: BatchState) -> Tensor:
    if state.rope_deltas is not None:
        return state.rope_deltas
    return state.mask.new_zeros(state.size)


def row_adapters(state: BatchState) -> list[Any]:
    """Each row's adapter (None for a base-model row)."""
    return list(state.adapters) if state.adapters is not None else [None] * state.size


def _pick(adapters: list[Any] | None, rows: list[int]) -> list[Any] | None:
    return None if adapters is None else [adapters[row] for row in rows]


def _pick_deltas(deltas: Tensor | None, index: Tensor) -> Tensor | None:
    return None if deltas is None else deltas.index_select(0, index)


def gather_rows(logits: Tensor, state: BatchState, rows: list[int]) -> tuple[Tensor, BatchState]:
    """Rows `rows` of a prefill's logits and state (a row may repeat)."""
    index = torch.tensor(rows, device=state.mask.device)
    keys = [k.index_select(0, index) for k in state.keys]
    values = [v.index_select(0, index) for v in state.values]
    mask = state.mask.index_select(0, index)
    deltas = _pick_deltas(state.rope_deltas, index)
    state = BatchState(keys, values, mask, _pick(state.adapters, rows), deltas)
    return logits.index_select(0, index), state


def select_rows(state: BatchState, rows: list[int]) -> BatchState | None:
    """Keep `rows` (in order) and trim leading columns that are padding in every kept row."""
    if not rows:
        return None
    index = torch.tensor(rows, device=state.mask.device)
    mask = state.mask.index_select(0, index)
    first_real = int(mask.any(0).nonzero()[0, 0]) if mask.any() else mask.shape[1]
    keys = [k.index_select(0, index)[:, :, first_real:] for k in state.keys]
    values = [v.index_select(0, index)[:, :, first_real:] for v in state.values]
    deltas = _pick_deltas(state.rope_deltas, index)
    return BatchState(keys, values, mask[:, first_real:], _pick(state.adapters, rows), deltas)
