"""The rollout manager and the rollout functions of one process share one tokenizer."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from miles.utils.tokenizers import load_tokenizer


def test_load_tokenizer_loads_once_per_path_and_tokenizes_as_auto_tokenizer(tiny_checkpoint: Path):
    path = str(tiny_checkpoint)
    tokenizer = load_tokenizer(path)
    assert load_tokenizer(path) is tokenizer
    text = "Which is larger, 3 or 8? ünïcödé"
    assert tokenizer(text)["input_ids"] == AutoTokenizer.from_pretrained(path)(text)["input_ids"]
