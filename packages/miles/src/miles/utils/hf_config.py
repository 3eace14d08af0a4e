"""Fields of a local Hugging Face checkpoint's config.json, read as JSON (importing transformers
costs seconds in processes that need one number from it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def hf_config_value(hf_checkpoint: str, key: str) -> Any:
    """`key` of the checkpoint's config.json, or of its `text_config` (multimodal and hybrid
    models nest the language model's there); None for a hub id or a config without it."""
    path = Path(hf_checkpoint) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    value = config.get(key)
    if value is None:
        value = (config.get("text_config") or {}).get(key)
    return value
