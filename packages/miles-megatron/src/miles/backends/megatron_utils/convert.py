"""Hugging Face <-> Megatron-core GPTModel weights for Qwen2, Qwen3 and Llama (local layer spec).

Pure tensor functions over full (not tensor-parallel) state dicts, float exact: only reshapes,
slices, concatenations and zero padding, never arithmetic. Megatron fuses q/k/v per query group
and gate/up into one matrix, and pads the vocabulary; see `hf_to_megatron` for the layouts.
Names carry global layer indices; mapping pipeline stages' local indices is the caller's job.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from miles.backends.megatron_utils.arguments import SUPPORTED_MODEL_TYPES, padded_vocab_size

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
# Megatron name inside decoder layer i -> HF name inside model.layers.i, for 1:1 tensors.
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
# Qwen3 only: RMSNorm over each head's q and k (Megatron's qk_layernorm).
_QK_NORM_RENAMES = {
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
_QK_NORM_MODELS = ("qwen3",)
_QKV_BIAS_MODELS = ("qwen2",)
_GLOBAL_RENAMES = {"decoder.final_layernorm.weight": "model.norm.weight"}
# PPO's value model: transformers' one-label token-classification head, in the output layer's slot.
_VALUE_HEAD_RENAMES = {
    "output_layer.score.weight": "score.weight",
    "output_layer.score.bias": "score.bias",
}


def attention_dims(hf_config: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads = Megatron's query groups, head dim) of `hf_config`."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return heads, kv_heads, head_dim


def hf_to_megatron(
    hf_state: dict[str, Tensor],
    hf_config: Any,
    *,
    vocab_divisible_by: int = 128,
    tp_size: int = 1,
    value_head: bool = False,
) -> dict[str, Tensor]:
    """The full Megatron GPTModel state dict of an HF Qwen2/Qwen3/Llama state dict.

    - q/k/v -> `linear_qkv`, fused per query group: for each of the num_key_value_heads groups,
      the q rows of that group's heads, then its k rows, then its v rows (biases alike, Qwen2).
    - gate/up -> `linear_fc1` = cat([gate, up]).
    - embedding and (untied) lm_head rows padded with zeros to
      `padded_vocab_size(vocab_size, vocab_divisible_by, tp_size)`.
    - `value_head` (PPO's value model, a one-label token-classification state dict): `score`
      -> `output_layer.score` instead of an lm_head, whatever the config says of tying.
    Every HF tensor is used exactly once; an unknown name raises. `lm_head.weight` of a tied
    model (some state dicts list it) is accepted only if it equals the embedding, and dropped.
    Megatron's `_extra_state` entries (None under the local spec) are not produced.
    """
    _check_model_type(hf_config)
    pending = {k: v for k, v in hf_state.items() if not k.endswith("rotary_emb.inv_freq")}
    vocab = padded_vocab_size(hf_config.vocab_size, vocab_divisible_by, tp_size)
    out = {
        "embedding.word_embeddings.weight": _pad_vocab(
            pending, "model.embed_tokens.weight", hf_config, vocab
        )
    }
    if value_head:
        out.update(_value_head_to_megatron(pending, hf_config))
    elif hf_config.tie_word_embeddings:
        head = pending.pop("lm_head.weight", None)
        if head is not None and not torch.equal(head, hf_state["model.embed_tokens.weight"]):
            raise ValueError(
                "the config ties word embeddings, but lm_head.weight differs from "
                "model.embed_tokens.weight; fix tie_word_embeddings in the config"
            )
    else:
        out["output_layer.weight"] = _pad_vocab(pending, "lm_head.weight", hf_config, vocab)
    out["decoder.final_layernorm.weight"] = _take(pending, "model.norm.weight")
    for i in range(hf_config.num_hidden_layers):
        out.update(_layer_to_megatron(pending, i, hf_config))
    if pending:
        raise ValueError(
            f"HF tensors with no Megatron counterpart for {hf_config.model_type}: "
            f"{sorted(pending)}; the converter supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return out


def _value_head_to_megatron(pending: dict[str, Tensor], hf_config: Any) -> dict[str, Tensor]:
    weight = _take(pending, "score.weight")
    if weight.shape != (1, hf_config.hidden_size):
        raise ValueError(
            f"score.weight has shape {tuple(weight.shape)}, but a value head is one label over "
            f"{hf_config.hidden_size} hidden units: (1, {hf_config.hidden_size}); save the critic "
            "with num_labels=1"
        )
    out = {"output_layer.score.weight": weight}
    if "score.bias" in pending:
        out["output_layer.score.bias"] = pending.pop("score.bias")
    return out


def _layer_to_megatron(pending: dict[str, Tensor], i: int, hf_config: Any) -> dict[str, Tensor]:
    hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
    renames = dict(_LAYER_RENAMES)
    if hf_config.model_type in _QK_NORM_MODELS:
        renames.update(_QK_NORM_RENAMES)
    out = {mg + mg_name: _take(pending, hf + hf_name) for mg_name, hf_name in renames.items()}
    kinds = ("weight", "bias") if hf_config.model_type in _QKV_BIAS_MODELS else ("weight",)
    for kind in kinds:
        q, k, v = (_take(pending, f"{hf}self_attn.{p}_proj.{kind}") for p in "qkv")
        out[f"{mg}self_attention.linear_qkv.{kind}"] = _fuse_qkv(q, k, v, hf_config)
    gate = _take(pending, f"{hf}mlp.gate_proj.weight")
    up = _take(pending, f"{hf}mlp.up_proj.weight")
    out[mg + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
    return out


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, hf_config: Any) -> Tensor:
    heads, groups, head_dim = attention_dims(hf_config)
    rest = q.shape[1:]  # (hidden,) for weights, () for biases
    q = q.reshape(groups, heads // groups * head_dim, *rest)
    k = k.reshape(groups, head_dim, *rest)
    v = v.reshape(groups, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)  # (groups * (q/g + 2) * hd, *rest)


def megatron_to_hf(mg_state: dict[str, Tensor], hf_config: Any) -> dict[str, Tensor]:
    """The HF state dict of a full Megatron GPTModel state dict: the inverse of `hf_to_megatron`.

    q/k/v and gate/up are split apart, vocabulary padding is cut off, `output_layer.weight` is
    dropped when the config ties embeddings, and a value head becomes `score`. Non-tensor
    entries (`_extra_state`) are skipped.
    """
    _check_model_type(hf_config)
    out: dict[str, Tensor] = {}
    for name, tensor in mg_state.items():
        if not isinstance(tensor, Tensor):
            continue
        for hf_name, hf_tensor in megatron_to_hf_named(name, tensor, hf_config):
            assert hf_name not in out, f"two Megatron tensors map to {hf_name}"
            out[hf_name] = hf_tensor
    return out


def megatron_to_hf_named(name: str, tensor: Tensor, hf_config: Any) -> list[tuple[str, Tensor]]:
    """The HF (name, tensor) pairs of one full Megatron parameter, as weight sync streams them.

    `name` may carry wrapper prefixes (`module.module.decoder...`); `tensor` must be the whole
    parameter (gathered over tensor parallelism). `_extra_state` entries give an empty list.
    """
    while name.startswith("module."):
        name = name[len("module.") :]
    if name.endswith("._extra_state"):
        return []
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", tensor[: hf_config.vocab_size])]
    if name == "output_layer.weight":
        if hf_config.tie_word_embeddings:
            return []  # the engine ties lm_head to embed_tokens itself
        return [("lm_head.weight", tensor[: hf_config.vocab_size])]
    if name in _GLOBAL_RENAMES:
        return [(_GLOBAL_RENAMES[name], tensor)]
    if name in _VALUE_HEAD_RENAMES:
        return [(_VALUE_HEAD_RENAMES[name], tensor)]
    m = _LAYER.fullmatch(name)
    if m is None:
        raise ValueError(f"unknown Megatron parameter {name!r}; no HF counterpart")
    i, rest = m.groups()
    hf = f"model.layers.{i}."
    renames = _LAYER_RENAMES | _QK_NORM_RENAMES
    if rest in renames:
        return [(hf + renames[rest], tensor)]
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = split_qkv(tensor, hf_config)
        return [
            (f"{hf}self_attn.{p}_proj.{kind}", t) for p, t in zip("qkv", (q, k, v), strict=True)
        ]
    if rest == "mlp.linear_fc1.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [(hf + "mlp.gate_proj.weight", gate), (hf + "mlp.up_proj.weight", up)]
    raise ValueError(f"unknown Megatron parameter {name!r}; no HF counterpart")


def split_qkv(fused: Tensor, hf_config: Any) -> tuple[Tensor, Tensor, Tensor]:
    """HF q, k, v (weights or biases) of a fused `linear_qkv` tensor of any whole number of query
    groups (the full tensor, or one tensor-parallel rank's slice)."""
    heads, groups, head_dim = attention_dims(hf_config)
    per_group = heads // groups
    rest = fused.shape[1:]
    grouped = fused.reshape(-1, (per_group + 2) * head_dim, *rest)  # (groups, (q/g+2)*hd, *rest)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    # contiguous: safetensors and the engine's loaders refuse strided views.
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))  # type: ignore[return-value]


def _take(pending: dict[str, Tensor], name: str) -> Tensor:
    try:
        return pending.pop(name)
    except KeyError:
        raise ValueError(f"the HF state dict has no {name!r}") from None


def _pad_vocab(pending: dict[str, Tensor], name: str, hf_config: Any, padded: int) -> Tensor:
    tensor = _take(pending, name)
    if tensor.shape[0] != hf_config.vocab_size:
        raise ValueError(
            f"{name} has {tensor.shape[0]} rows but the config's vocab_size is "
            f"{hf_config.vocab_size}; the checkpoint and config disagree"
        )
    padding = tensor.new_zeros(padded - tensor.shape[0], *tensor.shape[1:])
    return torch.cat([tensor, padding], dim=0)


def _check_model_type(hf_config: Any) -> None:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"no HF<->Megatron converter for model_type {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
