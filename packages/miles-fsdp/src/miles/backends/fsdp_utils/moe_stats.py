"""MoE routers in the train step: the load-balancing loss and the routing metrics.

Every train forward of a MoE model records each router's logits and chosen experts (a forward
hook: it sees replayed experts too). Over the real tokens of the micro-batch (padding left out):

- `train/moe/aux_loss`: the Switch-Transformer load-balancing loss, per layer E x sum_e f_e x P_e (f_e:
  share of the token-expert assignments that went to expert e, P_e: its mean router probability),
  averaged over layers; added to the loss times --moe-aux-loss-coef, with gradients through P;
- `train/moe/router_entropy`: mean entropy of a token's router distribution (nats);
- `train/moe/layer_<l>/load_max_over_mean`: the busiest expert's share over the even share 1/E (1 is
  perfectly balanced, E means one expert takes everything).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from miles.backends.training_utils.step.routing_replay import moe_routers


class MoEStats:
    """The routers of one MoE model, measured during train forwards."""

    def __init__(self, model: nn.Module, aux_loss_coef: float) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError("MoEStats needs a MoE model (top-k routers)")
        self.aux_loss_coef = aux_loss_coef
        self._calls: list[tuple[Tensor, Tensor]] | None = None
        for router in self.routers:
            router.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, inputs: tuple, output: tuple) -> None:
        if self._calls is not None:
            self._calls.append((output[0], output[-1]))  # logits (N, E), experts (N, k)

    @contextlib.contextmanager
    def measuring(self, real: Tensor, into: dict[str, Tensor]) -> Iterator[None]:
        """Measure one forward whose flattened tokens are real where `real` (N,) is True; `into`
        holds afterwards `aux_loss` (a differentiable scalar) and the metric pairs."""
        self._calls = []
        try:
            yield
            into.update(self._measure(self._calls, real))
        finally:
            self._calls = None

    def _measure(self, calls: list[tuple[Tensor, Tensor]], real: Tensor) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        aux_terms, entropy_sum = [], torch.zeros((), dtype=torch.float64)
        tokens = int(real.sum())
        for layer, (logits, experts) in enumerate(calls):
            mask = real.to(logits.device)
            probs = torch.softmax(logits[mask].float(), dim=-1)  # (n, E)
            num_experts = probs.shape[-1]
            counts = torch.bincount(experts[mask].reshape(-1), minlength=num_experts).float()
            share = counts / counts.sum().clamp(min=1)  # (E,), no gradient
            aux_terms.append(num_experts * (share * probs.mean(dim=0)).sum())
            entropy = -(probs * torch.log(probs.clamp(min=1e-20))).sum(-1)  # (n,)
            entropy_sum = entropy_sum + entropy.detach().double().sum().cpu()
            imbalance = float(share.max() * num_experts)
            out[f"moe/layer_{layer}/load_max_over_mean"] = _pair(imbalance * tokens, tokens)
        aux = torch.stack(aux_terms).mean()
        out["aux_loss"] = aux
        out["moe/aux_loss"] = _pair(float(aux.detach()) * tokens, tokens)
        out["moe/router_entropy"] = _pair(float(entropy_sum), tokens * len(calls))
        return out


def _pair(total: float, weight: float) -> Tensor:
    """(weighted sum, weight), as the train step aggregates metrics."""
    return torch.tensor([total, weight], dtype=torch.float64)
