"""A checkpoint's parameter names -> the names of the model transformers loaded from it.

transformers 5 renames some models' parameters on load: Qwen2.5-VL's hub layout keeps the vision
tower under `visual.*` and the language model under `model.*`, and in memory they are
`model.visual.*` and `model.language_model.*` (Qwen3-VL's hub layout is already its memory
layout). Weight updates arrive in the hub layout, which is what SGLang's Qwen-VL loaders take, so
they go through the same renamings `from_pretrained` applies: transformers' own conversion mapping
for the model, not a hand-written table. Only renamings: the mapping's tensor converters (fused
MoE experts) are the loader's business (`weight_sync.expert_layout`).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming, rename_source_key


def checkpoint_renamer(model: nn.Module) -> Callable[[str], str]:
    """`rename(checkpoint_name) -> model_name`, as `from_pretrained` renamed `model`'s weights;
    a name already in the model's layout comes back unchanged."""
    renamings = [
        transform
        for transform in get_model_conversion_mapping(model, add_legacy=False)
        if isinstance(transform, WeightRenaming)
    ]

    def rename(name: str) -> str:
        return rename_source_key(name, renamings, [])[0]

    return rename
