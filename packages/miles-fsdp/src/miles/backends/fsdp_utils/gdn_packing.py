"""Packed documents through Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): the
recurrent state and the short causal convolution restart at every document boundary.

A GDN layer in transformers takes the boundaries as the `cu_seq_lens_q` keyword and hands them to
the fla kernel as `cu_seqlens`, but its torch fallbacks (used whenever `flash-linear-attention` /
`causal-conv1d` are not installed: on CPU, and in our lock) drop them, and the conv call never
turns them into the `seq_idx` the causal-conv1d kernel reads. Run as one row, a document would
then continue the previous one's state. `enable_gdn_packing` swaps the two module-level functions
of each GDN modeling module for boundary-aware ones; the cached single-token decode path is left
alone (training never takes it).
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

_CONV = "causal_conv1d_fn"
_CHUNK = "torch_chunk_gated_delta_rule"
_BOUNDARY_AWARE = "_miles_boundary_aware"


def enable_gdn_packing(model: nn.Module) -> bool:
    """Make `model`'s GDN layers honour document boundaries; return whether it has any.

    Idempotent. Patches the modeling module of each GDN layer class (process-wide: every model of
    that family then honours `cu_seq_lens_q`, and behaves as before without it).
    """
    modules = {sys.modules[type(m).__module__] for m in model.modules() if _is_gdn_layer(m)}
    for module in modules:
        _patch(module)
    return bool(modules)


def boundary_kwargs(cu_seqlens: torch.Tensor, max_seqlen: int) -> dict:
    """Model-forward keywords naming the segments of a packed row (varlen attention and GDN)."""
    return {
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": max_seqlen,
        "max_length_k": max_seqlen,
    }


def _is_gdn_layer(module: nn.Module) -> bool:
    return type(module).__name__.endswith("GatedDeltaNet")


def _patch(module: ModuleType) -> None:
    missing = [name for name in (_CONV, _CHUNK) if not callable(getattr(module, name, None))]
    if missing:
        raise NotImplementedError(
            f"{module.__name__} has no {', '.join(missing)}: the FSDP backend cannot restart its "
            "Gated DeltaNet state at document boundaries; this transformers version's GDN layer "
            "is not supported for packed training"
        )
    if not getattr(getattr(module, _CONV), _BOUNDARY_AWARE, False):
        setattr(module, _CONV, _boundary_aware_conv(getattr(module, _CONV)))
    if not getattr(getattr(module, _CHUNK), _BOUNDARY_AWARE, False):
        setattr(module, _CHUNK, _boundary_aware_chunk_rule(getattr(module, _CHUNK)))


@functools.cache
def _kernel_installed(package: str) -> bool:
    """Whether transformers resolves the kernel from `package` (it imports it the same way)."""
    try:
        importlib.import_module(package)
    except Exception:
        return False
    return True


def _lengths(cu_seqlens: torch.Tensor, total: int, batch: int, what: str) -> list[int]:
    if batch != 1 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total:
        raise ValueError(
            f"{what}: document boundaries {cu_seqlens.tolist()} must cover one packed row of "
            f"{total} tokens from 0, got a batch of {batch}"
        )
    return cu_seqlens.diff().tolist()


def _boundary_aware_conv(conv: Callable) -> Callable:
    """Causal depthwise conv over (B, D, T) that does not reach back across a boundary."""

    @functools.wraps(conv)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu_seqlens = kwargs.pop("cu_seq_lens_q", None)
        if cu_seqlens is None:
            return conv(hidden_states, weight, bias, activation=activation, **kwargs)
        batch, _, total = hidden_states.shape
        lengths = _lengths(cu_seqlens, total, batch, "causal_conv1d_fn")
        if _kernel_installed("causal_conv1d"):  # the kernel restarts where seq_idx changes
            seq_idx = torch.repeat_interleave(
                torch.arange(len(lengths), dtype=torch.int32, device=hidden_states.device),
                torch.tensor(lengths, device=hidden_states.device),
            ).unsqueeze(0)  # (1, T)
            return conv(hidden_states, weight, bias, activation=activation, seq_idx=seq_idx)
        pieces = hidden_states.split(lengths, dim=-1)  # each (1, D, L_i)
        return torch.cat([conv(p, weight, bias, activation=activation) for p in pieces], dim=-1)

    setattr(causal_conv1d_fn, _BOUNDARY_AWARE, True)
    return causal_conv1d_fn


def _boundary_aware_chunk_rule(chunk_rule: Callable) -> Callable:
    """The chunked gated delta rule (Yang et al. 2024, arXiv:2412.06464) with the recurrent state
    reset at each boundary: per document on the torch path, natively in the fla kernel."""

    @functools.wraps(chunk_rule)
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, **kwargs):
        cu_seqlens = kwargs.get("cu_seqlens")
        if cu_seqlens is None or _kernel_installed("fla"):
            return chunk_rule(query, key, value, g=g, beta=beta, **kwargs)
        kwargs.pop("cu_seqlens")
        batch, total = query.shape[:2]
        lengths = _lengths(cu_seqlens, total, batch, "torch_chunk_gated_delta_rule")
        initial_state = kwargs.pop("initial_state", None)  # None or (N, H, K, V), one per document
        outputs, states = [], []
        splits = [x.split(lengths, dim=1) for x in (query, key, value, g, beta)]
        for i, (q, k, v, g_i, b_i) in enumerate(zip(*splits, strict=True)):
            state = None if initial_state is None else initial_state[i : i + 1]
            out, final = chunk_rule(q, k, v, g=g_i, beta=b_i, initial_state=state, **kwargs)
            outputs.append(out)  # (1, L_i, H, V)
            states.append(final)
        final_states = None if states[0] is None else torch.cat(states)  # (N, H, K, V)
        return torch.cat(outputs, dim=1), final_states

    setattr(torch_chunk_gated_delta_rule, _BOUNDARY_AWARE, True)
    return torch_chunk_gated_delta_rule
