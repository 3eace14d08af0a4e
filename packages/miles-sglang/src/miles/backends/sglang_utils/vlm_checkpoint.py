"""A vision-language checkpoint, as the engines and the trainers both see it: whether a config is
one (`is_vision_language`)."""

from __future__ import annotations

from typing import Any


def is_vision_language(config: Any) -> bool:
    """Whether a Hugging Face config is a vision-language model's (Qwen2.5-VL, Qwen3-VL): it has
    a vision tower."""
    return getattr(config, "vision_config", None) is not None
