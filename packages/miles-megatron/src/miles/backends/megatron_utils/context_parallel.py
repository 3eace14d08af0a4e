"""Context parallelism without Transformer Engine: each rank holds a slice of every sequence.

Megatron's layout, which its rotary embedding already follows (`get_pos_emb_on_this_cp_rank`):
a sequence padded to a multiple of 2 x cp is cut into 2 x cp equal chunks, and rank r holds
chunks r and 2cp-1-r, so every rank gets the same share of causal-attention work (an early chunk
attends to little, its mirror to almost everything).

Attention is the one place where tokens meet. Megatron's local `DotProductAttention` refuses
cp > 1 (only Transformer Engine's ring attention splits sequences), so `ContextParallelAttention`
takes its place in the layer spec: it all-gathers keys and values over the context-parallel group
(Llama 3's all-gather context parallelism: one collective per layer, cheap next to the attention
itself for grouped-query models) and masks by global position. Its backward sums each rank's
key/value gradients back onto the rank that owns them.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


def local_positions(
    length: int, cp_rank: int, cp_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions (L / cp,) of the tokens rank `cp_rank` holds of a length-`length`
    sequence, in the order it holds them, built on `device`."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} is not in a group of {cp_size}")
    if length % (2 * cp_size):
        raise ValueError(
            f"a sequence of {length} tokens cannot be split over {cp_size} context-parallel "
            f"ranks: pad it to a multiple of 2 x {cp_size} = {2 * cp_size}"
        )
    chunk = length // (2 * cp_size)
    early, late = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [
            torch.arange(early * chunk, (early + 1) * chunk, device=device),
            torch.arange(late * chunk, (late + 1) * chunk, device=device),
        ]
    )


def split_sequence(tensor: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This rank's slice of `tensor` along its sequence dimension `dim`."""
    index = local_positions(tensor.size(dim), cp_rank, cp_size, tensor.device)
    return tensor.index_select(dim, index)


def gathered_positions(
    length: int, cp_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions (L,) of an all-gather of every rank's slice, in its rank-major order."""
    return torch.cat([local_positions(length, r, cp_size, device) for r in range(cp_size)])


def all_gather_along(local: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Every rank's `local` concatenated along `dim` in rank order; the backward reduce-scatters
    each rank's gradient back to it (Megatron's sequence-parallel gather, over `group`)."""
    gathered = gather_from_sequence_parallel_region(local.movedim(dim, 0), group=group)
    return gathered.movedim(0, dim)


def gather_sequence(local: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """The whole sequence, in global order, from every rank's `split_sequence` slice; gradients
    flow back to the rank that owns each position."""
    gathered = all_gather_along(local, dim, group)
    held = gathered_positions(gathered.size(dim), dist.get_world_size(group), gathered.device)
    return gathered.index_select(dim, torch.argsort(held))


class ContextParallelAttention(MegatronModule):
    """Causal core attention over a sequence split across the context-parallel group.

    Built by megatron's `SelfAttention` from the layer spec, with `DotProductAttention`'s
    constructor arguments. Takes this rank's query [sq, b, heads, d] and key / value
    [sq, b, groups, d] (rotary embedding already applied at their global positions) and returns
    [sq, b, heads x d]: each local query attends to every key at or before its global position.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(
                f"ContextParallelAttention computes causal attention only, got {attn_mask_type}"
            )
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if config.apply_query_key_layer_scaling or softmax_type != "vanilla":
            raise ValueError(
                "ContextParallelAttention supports plain softmax attention only "
                f"(apply_query_key_layer_scaling={config.apply_query_key_layer_scaling}, "
                f"softmax_type={softmax_type!r})"
            )
        cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp if cp is not None else mpu.get_context_parallel_group()
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if (
            attention_mask is not None
            or attention_bias is not None
            or packed_seq_params is not None
        ):
            raise ValueError(
                "ContextParallelAttention builds its causal mask from global positions; it takes "
                "no attention mask, bias or packed-sequence parameters"
            )
        cp_size = dist.get_world_size(self.cp_group)
        cp_rank = dist.get_rank(self.cp_group)
        local, batch, heads, head_dim = query.shape
        length = local * cp_size
        # Keys and values stay in gathered (rank-major) order: the mask, not their order,
        # decides who sees whom.
        key = all_gather_along(key, 0, self.cp_group)
        value = all_gather_along(value, 0, self.cp_group)
        device = query.device
        query_at = local_positions(length, cp_rank, cp_size, device)
        key_at = gathered_positions(length, cp_size, device)
        visible = key_at[None, :] <= query_at[:, None]  # (sq, sk)
        groups = key.size(2)
        if groups != heads:
            # Repeated after the gather, so only the groups travel. Not every SDPA kernel takes
            # grouped heads (enable_gqa); with whole heads the mask-taking memory-efficient one
            # stays eligible instead of the math kernel's full [b, heads, sq, sk] scores.
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        dropout = self.dropout if self.training else 0.0
        # Dropout draws from Megatron's tensor-parallel RNG stream, as its own attention does.
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout else contextlib.nullcontext()
        with rng:
            context = F.scaled_dot_product_attention(
                query.permute(1, 2, 0, 3),  # (b, heads, sq, d)
                key.permute(1, 2, 0, 3),  # (b, heads, sk, d)
                value.permute(1, 2, 0, 3),
                attn_mask=visible,
                dropout_p=dropout,
                scale=self.softmax_scale,
            )
        return context.permute(2, 0, 1, 3).reshape(local, batch, heads * head_dim)
