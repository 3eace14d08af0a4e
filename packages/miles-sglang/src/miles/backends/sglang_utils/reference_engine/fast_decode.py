"""Prefill and decode steps of a dense Llama-layout model as the tensor ops they are, without the
HF forward.

A decode step reads one token per row, so its matmuls are small and the Hugging Face forward's
per-call work (mask building, cache objects, kwargs plumbing, module calls, SDPA's set-up) is a
large share of it on CPU: about 10% of a step for a 4-layer, 256-wide model at 64 rows, where the
matmuls themselves are ~60%. `DenseDecoder` runs the same ops in the same order for the
architectures whose forward is exactly embedding -> [RMSNorm, attention (grouped, rotary, optional
q/k norms), residual, RMSNorm, gated MLP, residual] x layers -> RMSNorm -> lm_head (Llama, Qwen2,
Qwen3), reading the modules' weights at every step (weight updates apply at once) and calling the
model's own rotary embedding (its scaling rules included). Anything else keeps the HF forward
(`DenseDecoder.for_model` says why). With LoRA serving, each projection adds its rows' adapter
terms (`lora_layers.LoraLayers.add_delta`), as the HF forward's layers do through their hooks.

A prefill runs the same layers over every prompt position (torch's SDPA with the causal and
padding mask, grouped KV heads as they are) and puts only the positions asked for through the
output head: the last one, unless the prompt is scored. It skips the HF forward's per-call work
as a decode step does (8 prompts of 9 tokens, 4 layers, 256 wide: 6.7 ms against 8.0 ms).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from miles.backends.sglang_utils.reference_engine.batch_cache import append_kv
from miles.backends.sglang_utils.reference_engine.lora_layers import LoraLayers

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

    def __init__(self, model: nn.Module, lora: LoraLayers | None = None) -> None:
        config = model.config
        self.model = model
        self.lora = lora
        # Without LoRA a projection is the plain product: no per-call check in the decode step.
        self._project: Callable[[nn.Linear, Tensor], Tensor] = (
            _linear if lora is None else self._adapted_linear
        )
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
    def for_model(
        cls, model: nn.Module, lora: LoraLayers | None = None
    ) -> tuple[DenseDecoder | None, str]:
        """(a decoder, "") when `model`'s forward is one `DenseDecoder` reproduces, else
        (None, why not). `lora`: the adapters of the rows, applied in every projection."""
        why = _unsupported(model)
        return (None, why) if why else (cls(model, lora), "")

    def step(
        self, tokens: Tensor, positions: Tensor, mask: Tensor, keys: list[Tensor],
        values: list[Tensor],
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:  # fmt: skip
        """Feed `tokens` (B,) at `positions` (B,) to a batch whose cache is `keys` / `values`
        (per layer (B, kv_heads, L, head_dim)) and whose (B, L + 1) `mask` marks the real
        columns, the new one included. Returns the next-token logits (B, V) and the grown
        caches (appended in place where their buffers have room)."""
        batch, kv_heads, dim = tokens.shape[0], self.kv_heads, self.head_dim
        group = self.heads // kv_heads
        x = F.embedding(tokens[:, None], self.embed.weight)  # (B, 1, hidden)
        # Additive mask over the keys, one row per (row, kv head): padding columns get -inf
        # (every row has its new token, so no softmax row is all -inf).
        bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device)
        bias = bias.masked_fill_(mask == 0, float("-inf")).repeat_interleave(kv_heads, 0)
        bias = bias[:, None, :]  # (B * kv_heads, 1, L + 1)
        softmax_dtype = torch.promote_types(x.dtype, torch.float32)
        new_keys, new_values = [], []

        def attend(index: int, layer: _Layer, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            all_k = append_kv(keys[index], k)
            all_v = append_kv(values[index], v)
            new_keys.append(all_k)
            new_values.append(all_v)
            # Grouped attention: the `group` query heads of a kv head read its keys in one bmm,
            # without copying the cache per query head.
            length = all_k.shape[2]
            scores = torch.baddbmm(
                bias,
                q.reshape(batch * kv_heads, group, dim),
                all_k.reshape(batch * kv_heads, length, dim).transpose(1, 2),
                alpha=layer.scaling,
            )  # (B * kv_heads, group, L + 1)
            probs = scores.softmax(-1, dtype=softmax_dtype).to(x.dtype)
            attended = torch.bmm(probs, all_v.reshape(batch * kv_heads, length, dim))
            return attended.view(batch, 1, self.heads * dim)

        x = self._layers(x, positions[:, None], attend)
        return self._head(x[:, -1]), new_keys, new_values

    def prefill(
        self, input_ids: Tensor, mask: Tensor, positions: Tensor, *, every_position: bool
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Run left-padded prompts `input_ids` (B, S), whose `mask` marks the real tokens, at
        `positions` (B, S). Returns the logits (B, S, V) with `every_position`, else those of the
        last position only (B, 1, V), and each layer's keys and values (B, kv_heads, S, dim).

        Only the positions asked for go through the output head: a prefill that scores no
        prompt needs the last one, which saves a (S, vocab) product per prompt."""
        batch, seq = input_ids.shape
        x = F.embedding(input_ids, self.embed.weight)  # (B, S, hidden)
        real = mask.bool()
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        # A padding position may see itself only: it then has one key to attend to (no row of
        # the softmax is all -inf), and no real position ever sees it.
        visible = (causal & real[:, None, :]) | torch.eye(seq, dtype=torch.bool, device=x.device)
        visible = visible[:, None]  # (B, 1, S, S), broadcast over heads
        grouped = self.heads != self.kv_heads
        new_keys, new_values = [], []

        def attend(index: int, layer: _Layer, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            new_keys.append(k)
            new_values.append(v)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=visible, scale=layer.scaling, enable_gqa=grouped
            )  # (B, heads, S, dim)
            return out.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim)

        x = self._layers(x, positions, attend)
        return self._head(x if every_position else x[:, -1:]), new_keys, new_values

    def _layers(self, x: Tensor, positions: Tensor, attend: Callable[..., Tensor]) -> Tensor:
        """The decoder layers over hidden states `x` (B, S, hidden) at `positions` (B, S);
        `attend(index, layer, q, k, v)` turns layer `index`'s rotated queries (B, heads, S, dim)
        and keys and values (B, kv_heads, S, dim) into its (B, S, heads * dim) output."""
        batch, seq = x.shape[:2]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        cos, sin = self.rotary(x, positions)  # (B, S, dim)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        for index, layer in enumerate(self.layers):
            h = _rms_norm(layer.input_norm, x)
            q = self._project(layer.q_proj, h).view(batch, seq, heads, dim).transpose(1, 2)
            k = self._project(layer.k_proj, h).view(batch, seq, kv_heads, dim).transpose(1, 2)
            v = self._project(layer.v_proj, h).view(batch, seq, kv_heads, dim).transpose(1, 2)
            if layer.q_norm is not None:
                q = _rms_norm(layer.q_norm, q)
            if layer.k_norm is not None:
                k = _rms_norm(layer.k_norm, k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            x = x + self._project(layer.o_proj, attend(index, layer, q, k, v))
            h = _rms_norm(layer.post_norm, x)
            gate = layer.act_fn(self._project(layer.gate_proj, h))
            gated = gate * self._project(layer.up_proj, h)
            x = x + self._project(layer.down_proj, gated)
        return x

    def _adapted_linear(self, module: nn.Linear, x: Tensor) -> Tensor:
        """`module` on `x`, plus the LoRA terms of the rows' adapters."""
        assert self.lora is not None, "only a decoder with LoRA layers adapts its projections"
        return self.lora.add_delta(module, x, _linear(module, x))

    def _head(self, x: Tensor) -> Tensor:
        return _linear(self.lm_head, _rms_norm(self.norm, x))


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
