"""Which experts a MoE model routed each token to, recorded during prefill and decode.

SGLang (`--enable-return-routed-experts`, request field `return_routed_experts`) answers with
`meta_info["routed_experts"]`: base64 of a little-endian, C-order int32 array shaped
(tokens, moe_layers, top_k) over every token the model has read for the request, prompt and output
but the last output token (never fed back). Routing replay trains with exactly these experts.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor, nn

from miles.backends.training_utils.step.routing_replay import moe_routers


class RoutedExpertsRecorder:
    """Captures each router's expert indices of one forward pass, (tokens, layers, top_k)."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            name = type(model).__name__
            raise ValueError(
                f"--enable-return-routed-experts records a MoE model's routing, but {name} has "
                "no top-k router; drop the flag for a dense model"
            )
        self.top_k = int(self.routers[0].top_k)
        self._captured: list[Tensor] | None = None
        for router in self.routers:
            router.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, inputs: tuple, output: tuple) -> None:
        if self._captured is not None:
            self._captured.append(output[-1].detach())  # (tokens, top_k) indices

    @contextmanager
    def recording(self, rows: int, columns: int) -> Iterator[list[Tensor]]:
        """Record one forward over a (rows, columns) batch; the list holds one (rows, columns,
        layers, top_k) int32 tensor after the block."""
        self._captured = []
        result: list[Tensor] = []
        try:
            yield result
            if len(self._captured) != len(self.routers):
                raise RuntimeError(
                    f"recorded {len(self._captured)} routers in one forward, expected "
                    f"{len(self.routers)}"
                )
            stacked = torch.stack(self._captured, dim=1)  # (rows * columns, layers, top_k)
            result.append(stacked.reshape(rows, columns, len(self.routers), self.top_k).int().cpu())
        finally:
            self._captured = None


def encode_routed_experts(steps: list[Tensor]) -> str:
    """SGLang's `routed_experts`: base64 of the int32 (tokens, layers, top_k) array, C order
    (`training_utils.step.routing_replay.decode_routed_experts` reads it)."""
    array = torch.cat(steps).numpy().astype("<i4", copy=False)
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")
