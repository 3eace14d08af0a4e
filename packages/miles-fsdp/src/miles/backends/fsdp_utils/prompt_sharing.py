"""One forward of a prompt for all the samples of a micro-batch that share it (a GRPO group).

The samples of a group repeat their prompt; forwarding it once per sample spends most of a short
RL step's tokens on the same prefix. Here the distinct prompts of a micro-batch, but for their
last token, run as one padded batch that fills a KV cache. Each document then runs one row: its
prompt's last token and its response but the last token (which predicts nothing), with its
prompt's cache rows (gathered per document) as past keys and values, at positions that continue
the prompt. Every logit a loss reads comes out of these rows, in document order.

Attention sees exactly what a per-document forward sees, so the log-probs are the same, and the
gradient of a shared prompt is the sum over its samples, as it is when each sample holds its own
copy. Cost: the prompt once per group instead of once per sample, plus one token per document.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from miles.backends.sglang_utils.vlm_checkpoint import is_vision_language
from miles.backends.training_utils.batching.packing import PAD_TOKEN_ID, PackedBatch


@dataclass(frozen=True)
class SharedPrompts:
    """A micro-batch as distinct prompt prefixes (G rows) and one row per document with a
    response (N rows, in the packed row's order)."""

    prefixes: Tensor
    """(G, P) long: each distinct prompt but its last token, right-padded (P >= 1)."""
    prefix_lengths: Tensor
    """(G,) long."""
    rows: Tensor
    """(N, R) long: a document's last prompt token, then its response tokens but the last,
    right-padded; position j predicts response token j."""
    response_lengths: Tensor
    """(N,) long: the tokens of each row, its response's length (>= 1)."""
    group: Tensor
    """(N,) long: the prefix each row continues."""

    @property
    def num_tokens(self) -> int:
        """Tokens this layout forwards, padding included."""
        return self.prefixes.numel() + self.rows.numel()


def plan_shared_prompts(packed: PackedBatch) -> SharedPrompts | None:
    """The shared-prompt layout of `packed`, or None where it would not forward fewer tokens
    than the per-document padded batch (no two documents share a prompt, say)."""
    starts = packed.cu_seqlens[:-1].tolist()
    tokens = packed.input_ids[0]
    prefix_index: dict[tuple[int, ...], int] = {}
    prefixes: list[Tensor] = []
    rows: list[Tensor] = []
    group: list[int] = []
    for start, (begin, stop) in zip(starts, packed.response_slices, strict=True):
        if stop == begin:  # no response: nothing of it is read
            continue
        # `begin` holds the last prompt token, whose logits predict the first response token.
        prefix = tokens[start:begin]
        index = prefix_index.setdefault(tuple(prefix.tolist()), len(prefixes))
        if index == len(prefixes):
            prefixes.append(prefix)
        rows.append(tokens[begin:stop])
        group.append(index)
    if len(prefixes) == len(rows) or not any(len(prefix) for prefix in prefixes):
        return None  # nothing forwarded once that was forwarded per document before
    plan = SharedPrompts(
        prefixes=_right_padded(prefixes),
        prefix_lengths=torch.tensor([len(p) for p in prefixes]),
        rows=_right_padded(rows),
        response_lengths=torch.tensor([len(r) for r in rows]),
        group=torch.tensor(group),
    )
    return plan if plan.num_tokens < padded_batch_tokens(packed) else None


def padded_batch_tokens(packed: PackedBatch) -> int:
    """Tokens `packed_logits` forwards for `packed` on sdpa / eager: one row per document, each
    padded to the longest."""
    return len(packed.response_slices) * int(packed.cu_seqlens.diff().max())


def _right_padded(rows: list[Tensor]) -> Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=PAD_TOKEN_ID)


def shared_prompt_logits(model: nn.Module, plan: SharedPrompts, device: torch.device) -> Tensor:
    """(sum R, V) logits where each response token is predicted, documents in the packed row's
    order: what `packed_logits` gives at `response_positions`."""
    group = plan.group.to(device)
    prefix_lengths = plan.prefix_lengths.to(device)[group]  # (N,)
    width = plan.prefixes.shape[1]
    prefilled = DynamicCache(config=model.config)
    # Right padding needs no mask here: causal attention never lets a prefix token see the
    # padding after it, and the rows' mask below hides the padding's keys. The head runs on
    # one column only: no loss reads a prefix's logits.
    prefix_logits = model(
        input_ids=plan.prefixes.to(device), past_key_values=prefilled, use_cache=True,
        logits_to_keep=1,
    ).logits  # fmt: skip
    cache = DynamicCache(config=model.config)
    for index, layer in enumerate(prefilled.layers):
        keys, values = layer.keys.index_select(0, group), layer.values.index_select(0, group)
        cache.update(keys, values, index)
    length = plan.rows.shape[1]
    real = torch.arange(length, device=device) < plan.response_lengths.to(device)[:, None]
    real_keys = torch.cat(
        [torch.arange(width, device=device) < prefix_lengths[:, None], real], dim=1
    )  # (N, P + R): which cached and new keys are real
    positions = prefix_lengths[:, None] + torch.arange(length, device=device)  # (N, R)
    logits = model(
        input_ids=plan.rows.to(device),
        position_ids=positions,
        attention_mask=real_keys.long(),
        past_key_values=cache,
        use_cache=True,
    ).logits  # (N, R, V)
    wanted = logits[real]  # one boolean gather, row-major: the documents in order
    return _ZeroGradTo.apply(wanted, prefix_logits)


class _ZeroGradTo(torch.autograd.Function):
    """`x` as it is, with `anchor` made part of its graph (its gradient: zeros).

    The prefix's gradient reaches its layers through the keys and values the rows read, never
    through the last layer's output. FSDP2 gathers a layer's parameters for its backward when
    the gradient reaches that output, so without this the last layer's backward would find its
    parameters resharded (--fsdp-gather micro_batch). Zeros, not `0 * anchor`: that is NaN
    wherever the anchor is not finite."""

    @staticmethod
    def forward(ctx, x: Tensor, anchor: Tensor) -> Tensor:
        ctx.anchor_shape, ctx.anchor_dtype = anchor.shape, anchor.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        zeros = grad.new_zeros(ctx.anchor_shape, dtype=ctx.anchor_dtype)
        return grad, zeros


def prompt_sharing_unsupported(
    model: nn.Module, *, attn_implementation: str, gradient_checkpointing: bool, moe: bool,
    packs_one_row: bool,
) -> str | None:  # fmt: skip
    """Why this model cannot forward a shared prompt once (None: it can)."""
    if is_vision_language(model.config):
        return "a vision-language model's prompts carry images, which the shared forward omits"
    if attn_implementation not in ("sdpa", "eager"):
        return f"--attn-implementation {attn_implementation} (sdpa and eager take its mask)"
    if packs_one_row:
        return "the model has Gated DeltaNet layers, whose state runs along one packed row"
    if moe:
        return "a MoE model's routers and routing replay read the per-document token layout"
    if gradient_checkpointing:
        return "--gradient-checkpointing (transformers turns the KV cache off with it)"
    layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        return f"layer types {sorted(layer_types)} (only full attention reuses a whole prompt)"
    parameters = inspect.signature(model.forward).parameters
    if not {"past_key_values", "logits_to_keep"} <= parameters.keys():
        return f"{type(model).__name__}.forward takes no past_key_values or logits_to_keep"
    return None
