"""Expert weights in the checkpoint layout: one tensor per expert and projection.

transformers >= 5 keeps a MoE layer's experts fused in memory (`mlp.experts.gate_up_proj`,
(E, 2I, H), and `mlp.experts.down_proj`, (E, H, I)) but reads and writes checkpoints per expert
(`mlp.experts.<e>.gate_proj.weight`, (I, H); `up_proj`; `down_proj`, (H, I)), and SGLang's MoE
loaders (e.g. its qwen3_moe.py, through `expert_params_mapping`) take only the per-expert names.
A weight update therefore goes out in the checkpoint layout (`split_fused_experts`, trainer side),
and an engine holding fused tensors loads it into views of them (`expert_views`, engine side).
The gate half comes first in `gate_up_proj`, as transformers' forward splits it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from torch import Tensor

_FUSED = re.compile(r"^(?P<experts>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def split_fused_experts(named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """`named` with every fused expert tensor replaced by its per-expert checkpoint tensors (views,
    no copy); every other pair passes unchanged."""
    for name, tensor in named:
        match = _FUSED.match(name)
        if match is None or tensor.dim() != 3:
            yield name, tensor
            continue
        yield from _per_expert(match["experts"], match["kind"], tensor)


def expert_views(named: Iterable[tuple[str, Tensor]]) -> dict[str, tuple[Tensor, str]]:
    """Checkpoint name -> (a view of the fused tensor it is a slice of, the fused tensor's name),
    for every fused expert tensor in `named`: copying into the view writes the fused tensor."""
    views = {}
    for name, tensor in named:
        match = _FUSED.match(name)
        if match is not None and tensor.dim() == 3:
            for part, view in _per_expert(match["experts"], match["kind"], tensor):
                views[part] = (view, name)
    return views


def _per_expert(experts: str, kind: str, tensor: Tensor) -> Iterator[tuple[str, Tensor]]:
    if kind == "down_proj":
        for e in range(tensor.shape[0]):
            yield f"{experts}.{e}.down_proj.weight", tensor[e]
        return
    if tensor.shape[1] % 2:
        raise ValueError(
            f"{experts}.gate_up_proj has shape {tuple(tensor.shape)}: its second dimension must "
            "hold the gate and up projections, two equal halves"
        )
    half = tensor.shape[1] // 2
    for e in range(tensor.shape[0]):
        yield f"{experts}.{e}.gate_proj.weight", tensor[e, :half]
        yield f"{experts}.{e}.up_proj.weight", tensor[e, half:]
