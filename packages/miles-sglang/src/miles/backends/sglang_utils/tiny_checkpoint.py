"""Small checkpoints of real architectures, built locally: nothing is downloaded.

`build_tiny_checkpoint` writes a Hugging Face directory (config, safetensors weights, tokenizer)
that `AutoModelForCausalLM.from_pretrained`, the reference engine and the trainers load like any
hub checkpoint. The tokenizer is a byte-level BPE with no merges (every byte is a token, as in
GPT-2/Qwen before merges) plus the chat special tokens, so any text round-trips
(`tiny_tokenizer`); vision-language checkpoints come from `tiny_vlm`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

from miles.backends.sglang_utils.tiny_tokenizer import SPECIAL_TOKENS, build_byte_tokenizer
from miles.backends.sglang_utils.tiny_vlm import TINY_VLMS, build_tiny_vlm


def tiny_qwen3_config(**overrides) -> transformers.Qwen3Config:
    """A Qwen3 config small enough to train on a laptop CPU; vocabulary matches the tokenizer."""
    settings = {
        "vocab_size": 256 + len(SPECIAL_TOKENS),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": 256,
        "pad_token_id": 256,
        "torch_dtype": "float32",
    }
    settings.update(overrides)
    return transformers.Qwen3Config(**settings)


def tiny_qwen3_moe_config(**overrides) -> transformers.Qwen3MoeConfig:
    """A Qwen3-MoE config as small as `tiny_qwen3_config`: 4 experts, 2 per token, every layer
    sparse; the router's auxiliary loss coefficient is the HF default."""
    settings = {
        **tiny_qwen3_config().to_dict(),
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    }
    for key in ("architectures", "model_type", "transformers_version", "dtype"):
        settings.pop(key, None)
    settings["torch_dtype"] = "float32"
    settings.update(overrides)
    return transformers.Qwen3MoeConfig(**settings)


TINY_CONFIGS = {"qwen3": tiny_qwen3_config, "qwen3_moe": tiny_qwen3_moe_config}
"""The architectures `build_tiny_checkpoint` builds, by HF model type."""


def build_tiny_checkpoint(
    path: str | Path, *, seed: int = 0, architecture: str = "qwen3", **config_overrides
) -> Path:
    """Write a randomly initialised (seeded) tiny checkpoint of `architecture` (a key of
    TINY_CONFIGS, or of tiny_vlm.TINY_VLMS for a vision-language model with its processor) and
    its tokenizer to `path`."""
    if architecture in TINY_VLMS:
        return build_tiny_vlm(path, seed=seed, architecture=architecture, **config_overrides)
    if architecture not in TINY_CONFIGS:
        choices = ", ".join([*TINY_CONFIGS, *TINY_VLMS])
        raise ValueError(f"no tiny {architecture!r} checkpoint; choose one of {choices}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[architecture](**config_overrides))
    model.save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer().save_pretrained(path)
    return path


def teach(
    path: str | Path, examples: list[tuple[list[int], range]], *, max_steps: int = 400
) -> None:
    """Train the checkpoint at `path` in place until it writes each example's `ids[span]`
    greedily after what precedes it (a tiny model that makes a tool call, say, for a test).
    Each example is (ids, span): the positions of `ids` the model must predict."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    batches = []
    for ids, span in examples:
        if span.start < 1 or span.stop > len(ids):
            raise ValueError(f"span {span} of {len(ids)} ids: predict positions 1..{len(ids) - 1}")
        batches.append((torch.tensor([ids]), span))
    for _ in range(max_steps):
        loss = sum(
            torch.nn.functional.cross_entropy(
                model(input_ids=ids).logits[0, span.start - 1 : span.stop - 1], ids[0, span]
            )
            for ids, span in batches
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:
            break
    model.save_pretrained(path)


def main(argv: list[str] | None = None) -> int:
    """`python -m miles.backends.sglang_utils.tiny_checkpoint OUT [--seed N] [--hidden-size ...]`."""
    import argparse

    parser = argparse.ArgumentParser(description=build_tiny_checkpoint.__doc__)
    parser.add_argument("out", help="directory to write the checkpoint to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--architecture", choices=sorted([*TINY_CONFIGS, *TINY_VLMS]), default="qwen3"
    )
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    args = parser.parse_args(argv)
    skip = ("out", "seed", "architecture")
    overrides = {k: v for k, v in vars(args).items() if k not in skip and v is not None}
    path = build_tiny_checkpoint(
        args.out, seed=args.seed, architecture=args.architecture, **overrides
    )
    print(f"wrote a tiny {args.architecture} checkpoint to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
