"""What the end-to-end runs train on: a seeded tiny Qwen3 checkpoint and a prompt file of
`max(a,b)=` questions with their answers (an exact-match reward can be earned)."""

from __future__ import annotations

import json
from pathlib import Path

from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint


def tiny_run_assets(
    root: Path, *, operands: int = 4, architecture: str = "qwen3"
) -> tuple[Path, Path]:
    """(checkpoint, prompt file) under `root`: max(a,b) for a, b in range(operands); the
    checkpoint a tiny `architecture` (tiny_checkpoint.TINY_CONFIGS)."""
    checkpoint = build_tiny_checkpoint(root / "ckpt", seed=0, architecture=architecture)
    data = root / "train.jsonl"
    rows = [
        {"input": f"max({a},{b})=", "label": str(max(a, b))}
        for a in range(operands)
        for b in range(operands)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return checkpoint, data


def random_lora_adapter(checkpoint: Path, out: Path, *, rank: int, seed: int = 0) -> Path:
    """A PEFT LoRA adapter (all-linear, alpha 2 * rank) of `checkpoint` with random, non-zero B
    as well as A, so the adapted model differs from the base from the first token on (a fresh
    adapter's B is zero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    adapted = get_peft_model(model, config)
    for name, param in adapted.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    adapted.save_pretrained(out)
    return out


def seeded_value_model(checkpoint: Path, out: Path, *, seed: int = 0) -> Path:
    """`checkpoint` as a one-label token-classification model (PPO's critic) with a seeded value
    head, saved with its tokenizer: a critic start whose head no run initialises itself."""
    import shutil

    import torch
    from transformers import AutoModelForTokenClassification

    shutil.copytree(checkpoint, out)
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_pretrained(checkpoint, num_labels=1)
    model.save_pretrained(out)
    return out
