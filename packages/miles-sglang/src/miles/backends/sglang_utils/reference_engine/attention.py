"""Grouped-query attention on CPU without copying the KV cache, for the engine's decode steps.

transformers' "sdpa" attention gives torch the grouped KV heads itself (`enable_gqa`) only when
there is no mask, because CUDA's fast kernels take no mask. Otherwise it first copies every KV
head once per query head it serves (`repeat_kv`). A running batch of left-padded rows always has
a mask, so every decode step copied the whole cache of every layer, 2-4x the attention's own time
on CPU, where torch's kernel takes masked grouped heads as they are. This attention is "sdpa"
with that copy left out; the engine uses it on CPU only.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GROUPED_SDPA = "miles_grouped_sdpa"


def grouped_sdpa_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **_: object,
) -> tuple[Tensor, None]:
    """(B, heads, Q, D) queries over (B, kv_heads, L, D) keys and values -> (B, Q, heads, D)."""
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As "sdpa": the causal flag only where no mask says more (a prefill without padding).
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=is_causal, enable_gqa=query.shape[1] != key.shape[1],
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: torch.nn.Module, device: torch.device) -> bool:
    """Switch `model` from "sdpa" to `grouped_sdpa_attention` on CPU; whether it switched."""
    if device.type != "cpu" or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # the same masks as "sdpa"
    model.set_attn_implementation(GROUPED_SDPA)
    return True
