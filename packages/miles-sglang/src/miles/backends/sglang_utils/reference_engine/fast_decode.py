"""A decode step of a dense Llama-layout model as the tensor ops it is, without the HF forward.

A decode step reads one token per row, so its matmuls are small and the Hugging Face forward's
per-call work (mask building, cache objects, kwargs plumbing, module calls, SDPA's set-up) is a
large share of it on CPU: about 10% of a step for a 4-layer, 256-wide model at 64 rows, where the
matmuls themselves are ~60%. `DenseDecoder` runs the same ops in the same order for the
architectures whose forward is exactly embedding -> [RMSNorm, attention (grouped, rotary, optional
q/k norms), residual, RMSNorm, gated MLP, residual] x layers -> RMSNorm -> lm_head (Llama, Qwen2,
Qwen3), reading the modules' weights at every step (weight updates apply at once) and calling the
model's own rotary embedding (its scaling rules included). Anything else keeps the HF forward
(`DenseDecoder.for_model` says why); prefill always uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from miles.backends.sglang_utils.reference_engine.batch_cache import append_kv

# model_type -> the causal-LM class whose forward `DenseDecoder` reproduces.
_SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_RMS_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}


@dataclass(frozen=True)
class _Layer:
    input_norm: nn.Module
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    scaling: float
    post_norm: nn.Module
    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear
    act_fn: nn.Module


def _rms_norm(module: nn.Module, x: Tensor) -> Tensor:
    """The HF RMSNorm of these models, op for op (statistics in float32, scale in x's dtype)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return module.weight * h.to(dtype)


def _linear(module: nn.Linear, x: Tensor) -> Tensor:
    return F.linear(x, module.weight, module.bias)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DenseDecoder:
    """Decode steps of one supported model; build it with `for_model`."""

    def __init__(self, model: nn.Module) -> None:
        config = model.config
        self.model = model
        self.embed = model.model.embed_tokens
        self.rotary = model.model.rotary_emb
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.layers = [
            _Layer(
                input_norm=layer.input_layernorm,
                q_proj=layer.self_attn.q_proj,
                k_proj=layer.self_attn.k_proj,
                v_proj=layer.self_attn.v_proj,
                o_proj=layer.self_attn.o_proj,
                q_norm=getattr(layer.self_attn, "q_norm", None),
                k_norm=getattr(layer.self_attn, "k_norm", None),
                scaling=layer.self_attn.scaling,
                post_norm=layer.post_attention_layernorm,
                gate_proj=layer.mlp.gate_proj,
                up_proj=layer.mlp.up_proj,
                down_proj=layer.mlp.down_proj,
                act_fn=layer.mlp.act_fn,
            )
            for layer in model.model.layers
        ]

    @classmethod
    def for_model(cls, model: nn.Module) -> tuple[DenseDecoder | None, str]:
        """(a decoder, "") when `model`'s forward is one `DenseDecoder` reproduces, else
        (None, why not)."""
        why = _unsupported(model)
        return (None, why) if why else (cls(model), "")

    def step(
        self, tokens: Tensor, positions: Tensor, mask: Tensor, keys: list[Tensor],
        values: list[Tensor],
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:  # fmt: skip
        """Feed `tokens` (B,) at `positions` (B,) to a batch whose cache is `keys` / `values`
        (per layer (B, kv_heads, L, head_dim)) and whose (B, L + 1) `mask` marks the real
        columns, the new one included. Returns the next-token logits (B, V) and the grown
        caches (appended in place where their buffers have room)."""
        batch, heads, kv_heads, dim = tokens.shape[0], self.heads, self.kv_heads, self.head_dim
        group = heads // kv_heads
        x = F.embedding(tokens, self.embed.weight)  # (B, hidden)
        cos, sin = self.rotary(x, positions[:, None])  # (B, 1, head_dim), broadcast over heads
        # Additive mask over the keys, one row per (row, kv head): padding columns get -inf
        # (every row has its new token, so no softmax row is all -inf).
        bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device)
        bias = bias.masked_fill_(mask == 0, float("-inf")).repeat_interleave(kv_heads, 0)
        bias = bias[:, None, :]  # (B * kv_heads, 1, L + 1)
        softmax_dtype = torch.promote_types(x.dtype, torch.float32)
        new_keys, new_values = [], []
        for layer, cached_k, cached_v in zip(self.layers, keys, values, strict=True):
            h = _rms_norm(layer.input_norm, x)
            q = _linear(layer.q_proj, h).view(batch, heads, dim)
            k = _linear(layer.k_proj, h).view(batch, kv_heads, dim)
            v = _linear(layer.v_proj, h).view(batch, kv_heads, 1, dim)
            if layer.q_norm is not None:
                q = _rms_norm(layer.q_norm, q)
            if layer.k_norm is not None:
                k = _rms_norm(layer.k_norm, k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            all_k = append_kv(cached_k, k.view(batch, kv_heads, 1, dim))
            all_v = append_kv(cached_v, v)
            new_keys.append(all_k)
            new_values.append(all_v)
            # Grouped attention: the `group` query heads of a kv head read its keys in one bmm,
            # without copying the cache per query head.
            length = all_k.shape[2]
            scores = torch.baddbmm(
                bias,
                q.view(batch * kv_heads, group, dim),
                all_k.reshape(batch * kv_heads, length, dim).transpose(1, 2),
                alpha=layer.scaling,
            )  # (B * kv_heads, group, L + 1)
            probs = scores.softmax(-1, dtype=softmax_dtype).to(x.dtype)
            attended = torch.bmm(probs, all_v.reshape(batch * kv_heads, length, dim))
            x = x + _linear(layer.o_proj, attended.view(batch, heads * dim))
            h = _rms_norm(layer.post_norm, x)
            gated = layer.act_fn(_linear(layer.gate_proj, h)) * _linear(layer.up_proj, h)
            x = x + _linear(layer.down_proj, gated)
        return _linear(self.lm_head, _rms_norm(self.norm, x)), new_keys, new_values


def _unsupported(model: nn.Module) -> str:
    """Why `DenseDecoder` cannot stand in for `model`'s forward ("" when it can)."""
    config = model.config
    expected = _SUPPORTED.get(getattr(config, "model_type", None))
    if expected is None or type(model).__name__ != expected:
        return f"{type(model).__name__} (model_type {config.model_type!r}) has no fast decode path"
    if getattr(config, "pretraining_tp", 1) != 1:
        return f"pretraining_tp {config.pretraining_tp} splits the linear layers"
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return f"layer types {sorted(set(layer_types))} include windowed attention"
    if not isinstance(model.model.embed_tokens, nn.Embedding):
        return "the input embedding is not a plain nn.Embedding"
    norms = [model.model.norm]
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        if getattr(attention, "sliding_window", None) is not None:
            return "a layer attends through a sliding window"
        linears = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj]
        linears += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(m) is not nn.Linear for m in linears):
            return "a projection is not a plain nn.Linear (quantized or adapted?)"
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [n for n in (getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)) if n is not None]  # fmt: skip
    if any(type(n).__name__ not in _RMS_NORMS for n in norms):
        return "a norm is not the architecture's RMSNorm"
    if type(model.lm_head) is not nn.Linear:
        return "the output head is not a plain nn.Linear"
    hooked = [
        name
        for name, module in model.named_modules()
        if module._forward_hooks or module._forward_pre_hooks
    ]
    if hooked:  # whoever hooked a module expects its forward to run
        return f"forward hooks on {hooked[:3]}"
    return ""
