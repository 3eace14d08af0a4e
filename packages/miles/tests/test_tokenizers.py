"""The rollout manager and the rollout functions of one process share one tokenizer, loaded
without torch where `AutoTokenizer` would pick the same class."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from miles.utils.tokenizers import direct_tokenizer_class, load_tokenizer


def test_load_tokenizer_loads_once_per_path_as_auto_tokenizer_would(tiny_checkpoint: Path):
    path = str(tiny_checkpoint)
    tokenizer = load_tokenizer(path)
    assert load_tokenizer(path) is tokenizer
    auto = AutoTokenizer.from_pretrained(path)
    assert direct_tokenizer_class(path) == "TokenizersBackend"  # the direct path was taken
    assert type(tokenizer) is type(auto)
    text = "Which is larger, 3 or 8? ünïcödé"
    assert tokenizer(text)["input_ids"] == auto(text)["input_ids"]
    messages = [{"role": "user", "content": text}]
    assert tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for name in ("eos_token_id", "pad_token_id", "all_special_ids"):
        assert getattr(tokenizer, name) == getattr(auto, name), name


def test_a_fresh_process_loads_the_tokenizer_without_importing_torch(tiny_checkpoint: Path):
    code = (
        "import sys; from miles.utils.tokenizers import load_tokenizer; "
        f"load_tokenizer({str(tiny_checkpoint)!r}); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("model_type", "tokenizer_config", "expected"),
    [
        ("qwen3", {"tokenizer_class": "Qwen2TokenizerFast"}, "Qwen2Tokenizer"),
        ("llama", {"tokenizer_class": "PreTrainedTokenizerFast"}, "PreTrainedTokenizerFast"),
        # AutoTokenizer overrides the named class for some model types, runs custom code for an
        # auto_map, and reads the model config when no class is named: all go through it.
        ("deepseek_v3", {"tokenizer_class": "LlamaTokenizerFast"}, None),
        (
            "qwen3",
            {"tokenizer_class": "Qwen2Tokenizer", "auto_map": {"AutoTokenizer": "x.T"}},
            None,
        ),
        ("qwen3", {}, None),
        ("qwen3", {"tokenizer_class": "SomeOtherTokenizer"}, None),
    ],
)
def test_only_plain_choices_skip_auto_tokenizer(
    tmp_path: Path, tiny_checkpoint: Path, model_type, tokenizer_config, expected
):
    shutil.copy(tiny_checkpoint / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert direct_tokenizer_class(str(tmp_path)) == expected


def test_a_hub_id_goes_through_auto_tokenizer():
    assert direct_tokenizer_class("Qwen/Qwen3-0.6B") is None
