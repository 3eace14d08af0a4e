"""A vision-language checkpoint, as the engines and the trainers both see it: whether a config is
one (`is_vision_language`), and its parameter names between the checkpoint and the model
transformers loads from it, in both directions.

transformers 5 renames some models' parameters on load: Qwen2.5-VL's hub layout keeps the vision
tower under `visual.*` and the language model under `model.*`, and in memory they are
`model.visual.*` and `model.language_model.*` (Qwen3-VL's hub layout is already its memory
layout). Weight updates travel in the hub layout, which is what SGLang's Qwen-VL loaders take: an
engine that holds the model in memory maps them forward (`checkpoint_renamer`), a trainer maps its
weights back before it sends or exports them (`checkpoint_names`). Both directions are
transformers' own conversion mapping for the model, not a hand-written table. Only renamings: the
mapping's tensor converters (fused MoE experts) are the loader's business
(`weight_sync.expert_layout`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def is_vision_language(config: Any) -> bool:
    """Whether a Hugging Face config is a vision-language model's (Qwen2.5-VL, Qwen3-VL): it has
    a vision tower."""
    return getattr(config, "vision_config", None) is not None


def checkpoint_renamer(model: nn.Module) -> Callable[[str], str]:
    """`rename(checkpoint_name) -> model_name`, as `from_pretrained` renamed `model`'s weights;
    a name already in the model's layout comes back unchanged."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [
        transform
        for transform in get_model_conversion_mapping(model, add_legacy=False)
        if isinstance(transform, WeightRenaming)
    ]

    def rename(name: str) -> str:
        return rename_source_key(name, renamings, [])[0]

    return rename


def checkpoint_names(config: Any) -> dict[str, str]:
    """In-memory parameter name -> the name the checkpoint on disk (and SGLang's loader) uses, for
    a vision-language model's `config`; {} (names unchanged) for any other model.

    Weight sync and export must speak the checkpoint's names. The reversal is transformers' own
    (what `save_pretrained` does), run on the names of a model built on the meta device (each
    tensor a distinct marker), so every rank computes the same map without weights. A conversion
    that merges or splits tensors is not a renaming, and is refused here."""
    if not is_vision_language(config):
        return {}
    from transformers import AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    names = list(model.state_dict().keys())
    markers = {name: torch.tensor([index]) for index, name in enumerate(names)}
    reverted = revert_weight_conversion(model, markers)
    if len(reverted) != len(names):
        raise ValueError(
            f"{type(model).__name__}: transformers' checkpoint conversion maps {len(names)} "
            f"weights to {len(reverted)}; weight sync renames weights but cannot merge or split "
            "them for this architecture"
        )
    return {names[int(marker)]: name for name, marker in reverted.items()}
