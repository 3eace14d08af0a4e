"""One tokenizer per checkpoint per process.

The rollout manager reads its prompts with the checkpoint's tokenizer and the rollout functions
(SFT, tool and agent rollouts) render and tokenize with it again; they share this one instance
instead of each loading their own (`AutoTokenizer` imports transformers' auto classes, which
bring torch, so only the first caller pays seconds).
"""

from __future__ import annotations

import threading
from typing import Any

_LOCK = threading.Lock()  # the rollout manager reads prompts in a thread beside its event loop
_TOKENIZERS: dict[str, Any] = {}


def load_tokenizer(path: str) -> Any:
    """The tokenizer of the checkpoint at `path`, loaded once per process."""
    with _LOCK:
        if path not in _TOKENIZERS:
            from transformers import AutoTokenizer  # seconds of imports: see the module docstring

            _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
        return _TOKENIZERS[path]
