"""Each row's LoRA adapter inside the batched forward (Hu et al., 2021, "LoRA"): every adapted linear
layer computes y = x W^T + scaling * (x A^T) B^T with the adapter of the row (none: the base layer
alone), in PEFT's order of operations, so a batch that mixes adapters gives each row what it alone
would get. The Hugging Face forward gets the term through forward hooks on the adapted layers; the
engine's own decoder (`fast_decode`) calls `add_delta` where it multiplies by a weight.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from miles.backends.sglang_utils.reference_engine.lora_settings import LORA_TARGET_MODULES


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A loaded adapter, never changed: a request that started with it keeps it through an unload
    or a reload under its name. Compared by identity: a reload is another adapter, and so another
    key wherever prompts are shared."""

    name: str
    path: str
    rank: int
    scaling: float
    """Multiplies (x A^T) B^T: PEFT's lora_alpha / r (or / sqrt(r) with use_rslora)."""
    pinned: bool
    """SGLang's `pinned` (kept in its GPU pool); here only counted, every adapter stays loaded."""
    layers: dict[str, tuple[Tensor, Tensor]]
    """Module path -> (A (r, in), B (out, r)) on the engine's device, in the model's dtype."""


class LoraLayers:
    """The linear layers adapters may target (the projections of `LORA_TARGET_MODULES`), and the
    adapters of the rows being computed now (`batch`)."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        self.linears: dict[str, nn.Linear] = {
            path: module
            for path, module in model.named_modules()
            if type(module) is nn.Linear and path.rsplit(".", 1)[-1] in LORA_TARGET_MODULES
        }
        """Module path -> layer, for every projection an adapter may adapt."""
        self._paths = {id(module): path for path, module in self.linears.items()}
        self._groups: list[tuple[LoraAdapter, Tensor | None]] = []
        """While a batch runs: each adapter of its rows with their row indices (None: all)."""

    def hook_hf_forward(self) -> None:
        """Add the LoRA term to the Hugging Face forward's adapted layers. Installed after the
        fast decoder has checked the model: that decoder computes the term itself, and would
        otherwise take the hooks for someone else's and step aside."""
        for module in self.linears.values():
            module.register_forward_hook(self._hook)

    @contextlib.contextmanager
    def batch(self, adapters: Sequence[LoraAdapter | None]) -> Iterator[None]:
        """Within it, row i of every forward runs with `adapters[i]` (None: the base model)."""
        rows: dict[LoraAdapter, list[int]] = {}
        for row, adapter in enumerate(adapters):
            if adapter is not None:
                rows.setdefault(adapter, []).append(row)
        self._groups = [
            (adapter, None if len(indices) == len(adapters) else torch.tensor(indices, device=self.device))
            for adapter, indices in rows.items()
        ]  # fmt: skip
        try:
            yield
        finally:
            self._groups = []

    def add_delta(self, module: nn.Module, x: Tensor, out: Tensor) -> Tensor:
        """`out` (B, S, out) of `module` on `x` (B, S, in), plus each row's adapter's term."""
        if not self._groups:
            return out
        path = self._paths.get(id(module))
        if path is None:
            return out
        for adapter, rows in self._groups:
            matrices = adapter.layers.get(path)
            if matrices is None:  # this adapter leaves the layer alone
                continue
            a, b = matrices
            if rows is None:
                out = out + F.linear(F.linear(x, a), b) * adapter.scaling
            else:
                term = F.linear(F.linear(x.index_select(0, rows), a), b) * adapter.scaling
                out = out.index_add(0, rows, term)
        return out

    def _hook(self, module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        return self.add_delta(module, args[0], out)
