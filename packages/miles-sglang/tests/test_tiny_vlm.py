"""The tiny VLMs are real checkpoints: hub parameter names on disk, a processor that places and
expands the image tokens, and a forward that reads the image."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image, ImageDraw
from safetensors import safe_open
from transformers import AutoModelForImageTextToText, AutoProcessor

from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint
from miles.backends.sglang_utils.tiny_vlm import IMAGE_PAD_ID, VISION_START_ID


def _image(colour: str) -> Image.Image:
    image = Image.new("RGB", (100, 80), "white")
    ImageDraw.Draw(image).ellipse((10, 10, 40, 40), fill=colour)
    return image


# The hub checkpoints' own layouts, which SGLang's loaders read: Qwen2.5-VL keeps the tower under
# visual.* and the language model under model.*; Qwen3-VL nests both under model.
HUB_PREFIXES = {
    "qwen2_5_vl": ("visual.blocks.0.", "model.layers.0."),
    "qwen3_vl": ("model.visual.blocks.0.", "model.language_model.layers.0."),
}


@pytest.mark.parametrize("architecture", sorted(HUB_PREFIXES))
def test_tiny_vlm_is_a_hub_checkpoint_whose_forward_reads_the_image(tmp_path, architecture):
    path = build_tiny_checkpoint(tmp_path, architecture=architecture, seed=0)
    with safe_open(path / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    for prefix in HUB_PREFIXES[architecture]:
        assert any(n.startswith(prefix) for n in names), (prefix, sorted(names)[:5])
    assert json.loads((path / "config.json").read_text())["model_type"] == architecture

    processor = AutoProcessor.from_pretrained(path)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[_image("red")], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    merged = int(inputs["image_grid_thw"].prod()) // 4  # 2x2 patches per token
    assert ids.count(IMAGE_PAD_ID) == merged > 1
    assert ids[ids.index(VISION_START_ID) + 1] == IMAGE_PAD_ID

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float64)
    with torch.no_grad():
        red = model(**inputs).logits
        blue_inputs = processor(text=[text], images=[_image("blue")], return_tensors="pt")
        blue = model(**blue_inputs).logits
    assert red.shape[-1] == model.config.text_config.vocab_size
    assert not torch.allclose(red[0, -1], blue[0, -1])  # the answer depends on the pixels
