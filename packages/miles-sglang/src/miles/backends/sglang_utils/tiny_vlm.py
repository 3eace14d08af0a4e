"""Small vision-language checkpoints of real architectures (Qwen2.5-VL, Qwen3-VL), built locally.

A directory written here holds what a hub VLM holds: config, safetensors weights in the hub's
parameter names (`visual.*`, `model.layers.*`: what SGLang's loaders and `from_pretrained` read),
the byte-level tokenizer with Qwen's vision tokens, and the model's own processor
(`AutoProcessor.from_pretrained(path)` gives the image processor that resizes and patches images,
and the chat template that places `<|vision_start|><|image_pad|><|vision_end|>` where a message has
an image; the processor expands the pad to one token per merged patch).

Images are kept small (at most 112x112 pixels after resizing: 16 image tokens) so that a CPU
trains on them; the sizes are the processor's settings, not a hand-written preprocessing.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import AutoModelForImageTextToText, PreTrainedTokenizerFast

from miles.backends.sglang_utils.tiny_tokenizer import SPECIAL_TOKENS, build_byte_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + len(VISION_TOKENS)
# Ids as the byte tokenizer assigns them: after the 256 bytes and the three chat tokens.
VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID = range(259, 263)

# The tiny text models' ChatML, with one change: a message's content may be a list of parts
# (OpenAI's and transformers' form), text parts written as they are and each image part as Qwen's
# vision span. String contents render exactly as the text-only template renders them.
_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% endif %}{% endfor %}{% endif %}"
)
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    + _CONTENT
    + "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Smallest and largest image after the processor's resize, in pixels: a 28x28 merged patch is one
# token, so images cost between 4 and 16 tokens.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112


def build_vlm_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]}
    )
    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    assert ids == list(range(VISION_START_ID, VIDEO_PAD_ID + 1)), ids
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def _text_settings(head_dim: int) -> dict:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "max_position_embeddings": 1024,
        "bos_token_id": None,
        "eos_token_id": 256,
        "pad_token_id": 256,
        # Multimodal rotary embedding: the head's 8 frequency pairs split over time, height and
        # width positions (Qwen's mrope; the sections sum to head_dim / 2).
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": [2, 3, 3]},
    }  # fmt: skip


def tiny_qwen2_5_vl_config(**overrides) -> transformers.Qwen2_5_VLConfig:
    vision = {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1],
    }  # fmt: skip
    return transformers.Qwen2_5_VLConfig(**_vlm_settings(vision, overrides))


def tiny_qwen3_vl_config(**overrides) -> transformers.Qwen3VLConfig:
    vision = {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0],
    }  # fmt: skip
    return transformers.Qwen3VLConfig(**_vlm_settings(vision, overrides))


def _vlm_settings(vision: dict, overrides: dict) -> dict:
    text = _text_settings(head_dim=16)
    text.update(overrides.pop("text_config", {}))
    settings = {
        "text_config": text,
        "vision_config": vision,
        "image_token_id": IMAGE_PAD_ID,
        "video_token_id": VIDEO_PAD_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    settings.update(overrides)
    return settings


def _qwen2_5_vl_processor(tokenizer):
    return transformers.Qwen2_5_VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(
            min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, merge_size=2
        ),
        video_processor=transformers.Qwen2VLVideoProcessor(),
        tokenizer=tokenizer,
        chat_template=VLM_CHAT_TEMPLATE,
    )


def _qwen3_vl_processor(tokenizer):
    return transformers.Qwen3VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(
            min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, merge_size=2
        ),
        video_processor=transformers.Qwen3VLVideoProcessor(patch_size=14),
        tokenizer=tokenizer,
        chat_template=VLM_CHAT_TEMPLATE,
    )


TINY_VLMS = {
    "qwen2_5_vl": (tiny_qwen2_5_vl_config, _qwen2_5_vl_processor),
    "qwen3_vl": (tiny_qwen3_vl_config, _qwen3_vl_processor),
}
"""The vision-language architectures `build_tiny_vlm` builds, by HF model type."""


def build_tiny_vlm(
    path: str | Path, *, seed: int = 0, architecture: str = "qwen2_5_vl", **config_overrides
) -> Path:
    """Write a randomly initialised (seeded) tiny VLM of `architecture` (a key of TINY_VLMS),
    its tokenizer and its processor to `path`."""
    if architecture not in TINY_VLMS:
        raise ValueError(f"no tiny {architecture!r} VLM; choose one of {', '.join(TINY_VLMS)}")
    make_config, make_processor = TINY_VLMS[architecture]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(make_config(**config_overrides))
    model.save_pretrained(path, safe_serialization=True)
    make_processor(build_vlm_tokenizer()).save_pretrained(path)
    return path
