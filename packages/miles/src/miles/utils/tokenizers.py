"""One tokenizer per checkpoint per process, loaded without torch where that gives the same one.

The rollout manager reads its prompts with the checkpoint's tokenizer and the rollout functions
(SFT, tool and agent rollouts) render and tokenize with it again; they share this one instance
instead of each loading their own.

`AutoTokenizer` reads the model config to pick the class, and transformers' config module imports
torch: 2.6-4 s of a 2-core machine's start-up, in a process (the rollout manager) that otherwise
never needs torch, while the other processes of a run import theirs. For a local checkpoint of
an architecture whose choice is plain (`_DIRECT_MODEL_TYPES`: `AutoTokenizer` takes the class its
tokenizer_config.json names, "Fast" dropped) that class is loaded directly, in about 0.7 s; every
other checkpoint goes through `AutoTokenizer`.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

_LOCK = threading.Lock()  # the rollout manager reads prompts in a thread beside its event loop
_TOKENIZERS: dict[str, Any] = {}

# Model types for which transformers 5's AutoTokenizer loads the class named in
# tokenizer_config.json (none is in its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), and the class
# names it maps that way.
_DIRECT_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})
_DIRECT_CLASSES = frozenset({
    "TokenizersBackend", "PreTrainedTokenizerFast", "LlamaTokenizer", "Qwen2Tokenizer",
})  # fmt: skip


def load_tokenizer(path: str) -> Any:
    """The tokenizer of the checkpoint at `path`, loaded once per process."""
    with _LOCK:
        if path not in _TOKENIZERS:
            direct = direct_tokenizer_class(path)
            if direct is not None:
                import transformers  # lazy: only the named class's module is imported

                _TOKENIZERS[path] = getattr(transformers, direct).from_pretrained(path)
            else:
                from transformers import AutoTokenizer  # seconds: see the module docstring

                _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
        return _TOKENIZERS[path]


def load_processor(path: str) -> Any:
    """The checkpoint's processor (`AutoProcessor`: for a vision-language model, its image
    processor with its tokenizer and chat template), loaded once per process; None when the
    checkpoint has no processor beyond its tokenizer."""
    with _LOCK:
        key = f"processor:{path}"
        if key not in _TOKENIZERS:
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(path)
            # A text model's AutoProcessor is its tokenizer: it reads no images.
            _TOKENIZERS[key] = processor if hasattr(processor, "image_processor") else None
        return _TOKENIZERS[key]


def direct_tokenizer_class(path: str) -> str | None:
    """The tokenizer class `AutoTokenizer` would load for the local checkpoint at `path`, when
    that needs no config machinery to decide; None: ask `AutoTokenizer`."""
    directory = Path(path)
    try:
        tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
        model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):  # not a local checkpoint (a hub id), or no such files
        return None
    name = tokenizer_config.get("tokenizer_class")
    if not isinstance(name, str) or "auto_map" in tokenizer_config:  # custom code: AutoTokenizer
        return None
    if name != "PreTrainedTokenizerFast":
        name = name.removesuffix("Fast")
    if model_type not in _DIRECT_MODEL_TYPES or name not in _DIRECT_CLASSES:
        return None
    return name
