"""Routing replay for MoE models: the trainer's forward uses given experts for every token.

Without it the router of the trainer can pick other experts than the engine did for the same
token (a near tie, other kernels, another batch), and the trainer's log-probs drift from those the
sample was drawn with. Replay takes the experts as given (R3: the engine's, from its
`routed_experts`; R2: those of the old-policy forward, for the later optimizer steps of a rollout)
and recomputes the gating weights from the router's own logits over them, so the router still
gets gradients.

`RoutingReplay(model)` takes over the forward of every top-k router of a transformers MoE model
(Qwen2-MoE and Qwen3-MoE style: softmax over the logits, top-k, optional renormalization). Routing
in a forward is laid out as the router sees it: (tokens, layers, top_k), the model's flattened
token order; -1 means "the router's own choice" (padding, or the last token of a document, whose
experts no engine reports).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Routers whose forward is softmax -> top-k -> (renormalize): what `_route` recomputes.
SOFTMAX_TOP_K_ROUTERS = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter")


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers in layer order: modules with `top_k`, `num_experts` and a
    `weight`, whose forward returns (logits, weights, expert indices) as transformers' do."""
    return [
        module
        for module in model.modules()
        if hasattr(module, "top_k") and hasattr(module, "num_experts") and hasattr(module, "weight")
    ]


def decode_routed_experts(encoded: str, num_layers: int, top_k: int) -> Tensor:
    """SGLang's `meta_info["routed_experts"]` (base64 of little-endian int32, C order) as a
    (tokens, layers, top_k) long tensor."""
    raw = bytearray(base64.b64decode(encoded))
    if len(raw) % (4 * num_layers * top_k):
        raise ValueError(
            f"routed_experts holds {len(raw) // 4} expert ids, not a multiple of {num_layers} MoE "
            f"layers x top-{top_k}: the engine served another model than the trainer's"
        )
    flat = torch.frombuffer(raw, dtype=torch.int32) if raw else torch.zeros(0, dtype=torch.int32)
    return flat.long().reshape(-1, num_layers, top_k)


class RoutingReplay:
    """Replays or records the experts of every router of `model`."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(
                f"routing replay (--use-rollout-routing-replay, --use-routing-replay) is for MoE "
                f"models, and {type(model).__name__} has no top-k router; drop the flag"
            )
        unknown = sorted({type(r).__name__ for r in self.routers} - set(SOFTMAX_TOP_K_ROUTERS))
        if unknown:
            raise ValueError(
                f"routing replay recomputes softmax top-k gates ({', '.join(SOFTMAX_TOP_K_ROUTERS)}); "
                f"this model's routers are {unknown}: train it without routing replay"
            )
        self.top_k = int(self.routers[0].top_k)
        self._replay: Tensor | None = None  # (tokens, layers, top_k)
        self._recorded: list[Tensor] | None = None
        for layer, router in enumerate(self.routers):
            router.forward = self._forward_of(layer, router)

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @contextmanager
    def replaying(self, experts: Tensor) -> Iterator[None]:
        """Forwards in this block route token t of layer l to `experts[t, l]` (where >= 0)."""
        if experts.dim() != 3 or experts.shape[1:] != (self.num_layers, self.top_k):
            raise ValueError(
                f"replayed experts have shape {tuple(experts.shape)}; this model routes "
                f"(tokens, {self.num_layers} layers, top-{self.top_k})"
            )
        self._replay = experts
        try:
            yield
        finally:
            self._replay = None

    @contextmanager
    def recording(self) -> Iterator[list[Tensor]]:
        """The experts every router picks in this block; the list holds one (tokens, layers,
        top_k) long tensor per forward afterwards."""
        self._recorded, result = [], []
        try:
            yield result
            for start in range(0, len(self._recorded), self.num_layers):
                result.append(torch.stack(self._recorded[start : start + self.num_layers], dim=1))
        finally:
            self._recorded = None

    def _forward_of(self, layer: int, router: nn.Module):
        def forward(hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            return self._route(layer, router, hidden_states)

        return forward

    def _route(self, layer: int, router: nn.Module, hidden_states: Tensor):
        hidden_states = hidden_states.reshape(-1, router.weight.shape[-1])
        logits = F.linear(hidden_states, router.weight)  # (N, E)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        chosen = torch.topk(probs, router.top_k, dim=-1).indices  # (N, k)
        if self._replay is not None:
            given = self._replay[:, layer].to(chosen.device)
            if given.shape[0] != chosen.shape[0]:
                raise ValueError(
                    f"layer {layer} routes {chosen.shape[0]} tokens but {given.shape[0]} were "
                    "given to replay: the replayed layout differs from the forward's"
                )
            chosen = torch.where(given >= 0, given, chosen)
        if self._recorded is not None:
            self._recorded.append(chosen.detach())
        weights = probs.gather(-1, chosen)  # gradients reach the router through the softmax
        if getattr(router, "norm_topk_prob", False):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), chosen
