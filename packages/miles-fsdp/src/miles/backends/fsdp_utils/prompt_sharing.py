"""One forward of a prompt for all the samples of a micro-batch that share it (a GRPO group).

The samples of a group repeat their prompt; forwarding it once per sample spends most of a short
RL step's tokens on the same prefix. Here the distinct prompts of a micro-batch run as one padded
batch that fills a KV cache; each response then runs with its prompt's cache rows (gathered per
sample) as past keys and values, at positions that continue its prompt. Attention sees exactly
what a per-document forward sees, so the log-probs are the same and the gradients of the shared
prompt are the sum over its samples, as they are when each sample holds its own copy. Cost: the
prompt's tokens once per group instead of once per sample, and the last token of every response
(which predicts nothing) not at all.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from miles.backends.training_utils.packing import PAD_TOKEN_ID, PackedBatch


@dataclass(frozen=True)
class SharedPrompts:
    """A micro-batch laid out as distinct prompts (G rows) and responses (N rows, one per
    document with a response, in the packed row's order)."""

    prompts: Tensor
    """(G, P) long: each distinct prompt, right-padded."""
    prompt_lengths: Tensor
    """(G,) long."""
    responses: Tensor
    """(N, R) long: each response's tokens but its last (which predicts nothing), right-padded;
    R may be 0 when every response has one token."""
    response_lengths: Tensor
    """(N,) long: whole response lengths (>= 1)."""
    group: Tensor
    """(N,) long: the row of `prompts` each response continues."""

    @property
    def num_tokens(self) -> int:
        """Tokens this layout forwards, padding included."""
        return self.prompts.numel() + self.responses.numel()


def plan_shared_prompts(packed: PackedBatch) -> SharedPrompts | None:
    """The shared-prompt layout of `packed`, or None where it would not forward fewer tokens
    than the per-document padded batch (no two documents share a prompt, say)."""
    starts = packed.cu_seqlens[:-1].tolist()
    ends = packed.cu_seqlens[1:].tolist()
    tokens = packed.input_ids[0]
    prompt_rows: dict[tuple[int, ...], int] = {}
    prompts: list[Tensor] = []
    responses: list[Tensor] = []
    group: list[int] = []
    for (start, end), (begin, stop) in zip(
        zip(starts, ends, strict=True), packed.response_slices, strict=True
    ):
        if stop == begin:  # no response: nothing of it is read
            continue
        prompt = tokens[start : begin + 1]  # the last prompt token predicts the first response one
        row = prompt_rows.setdefault(tuple(prompt.tolist()), len(prompts))
        if row == len(prompts):
            prompts.append(prompt)
        responses.append(tokens[begin + 1 : end - 1])
        group.append(row)
    if len(prompts) == len(responses):
        return None
    lengths = [end - start for start, end in zip(starts, ends, strict=True)]
    plan = SharedPrompts(
        prompts=_right_padded(prompts),
        prompt_lengths=torch.tensor([len(p) for p in prompts]),
        responses=_right_padded(responses),
        response_lengths=torch.tensor([len(r) + 1 for r in responses]),
        group=torch.tensor(group),
    )
    per_document = len(lengths) * max(lengths)  # the padded batch packed_logits runs
    return plan if plan.num_tokens < per_document else None


def _right_padded(rows: list[Tensor]) -> Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=PAD_TOKEN_ID)


def shared_prompt_logits(model: nn.Module, plan: SharedPrompts, device: torch.device) -> Tensor:
    """(sum R, V) logits where each response token is predicted, documents in the packed row's
    order: what `packed_logits` gives at `response_positions`."""
    group = plan.group.to(device)
    prompt_lengths = plan.prompt_lengths.to(device)
    cache = DynamicCache(config=model.config)
    # Right padding needs no mask here: causal attention never lets a prompt token see the
    # padding after it, and the responses' mask below hides the padding's keys.
    last, row_of_last = torch.unique(plan.prompt_lengths - 1, return_inverse=True)
    prompt_logits = model(
        input_ids=plan.prompts.to(device),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=last.to(device),
    ).logits  # (G, len(last), V)
    # Each response's first token is predicted at its prompt's last position.
    prompt_rows = torch.arange(plan.prompts.shape[0], device=device)
    first = prompt_logits[prompt_rows, row_of_last.to(device)].index_select(0, group)  # (N, V)
    num_responses, width = plan.responses.shape
    if width == 0:
        return first
    per_response = DynamicCache(config=model.config)
    for index, layer in enumerate(cache.layers):
        keys, values = layer.keys.index_select(0, group), layer.values.index_select(0, group)
        per_response.update(keys, values, index)
    read = plan.response_lengths.to(device) - 1  # (N,) tokens of each response row
    real_keys = torch.cat(
        [
            torch.arange(plan.prompts.shape[1], device=device) < prompt_lengths[group, None],
            torch.arange(width, device=device) < read[:, None],
        ],
        dim=1,
    )  # (N, P + R): which cached and new keys are real
    positions = prompt_lengths[group, None] + torch.arange(width, device=device)  # (N, R)
    logits = model(
        input_ids=plan.responses.to(device),
        position_ids=positions,
        attention_mask=real_keys.long(),
        past_key_values=per_response,
        use_cache=True,
    ).logits  # (N, R, V)
    # One gather in document order: [first, response rows...] per document.
    rows = torch.arange(num_responses, device=device).unsqueeze(1)  # (N, 1)
    columns = torch.arange(width, device=device)  # (R,)
    order = torch.cat([rows, num_responses + rows * width + columns], dim=1)  # (N, 1 + R)
    real = torch.arange(1 + width, device=device) <= read[:, None]  # (N, 1 + R)
    return torch.cat([first, logits.reshape(-1, logits.shape[-1])])[order[real]]


def prompt_sharing_unsupported(
    model: nn.Module, *, attn_implementation: str, gradient_checkpointing: bool, moe: bool,
    packs_one_row: bool,
) -> str | None:  # fmt: skip
    """Why this model cannot forward a shared prompt once (None: it can)."""
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
