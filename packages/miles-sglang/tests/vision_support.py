"""The vision tests' engine and references: a tiny VLM served in-process, its processor, and the
float64 Hugging Face forward that the engine's log-probs are checked against."""

from __future__ import annotations

import base64
import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from PIL import Image, ImageDraw
from transformers import AutoModelForImageTextToText, AutoProcessor, DynamicCache

from miles.backends.sglang_utils.reference_engine import ReferenceEngine, ReferenceEngineConfig
from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

from .in_process_engine import serve_in_process


@dataclass
class VisionEngine:
    path: Path
    engine: ReferenceEngine
    client: httpx.Client
    processor: Any
    reference: torch.nn.Module
    """The checkpoint's model in float64: what the engine's log-probs must equal."""


@contextlib.contextmanager
def serve_vlm(directory: Path, architecture: str) -> Iterator[VisionEngine]:
    path = build_tiny_checkpoint(directory, architecture=architecture, seed=0)
    config = ReferenceEngineConfig(model_path=str(path), device="cpu", admission_quiet_ms=0)
    with serve_in_process(config) as (engine, client):
        yield VisionEngine(path, engine, client, AutoProcessor.from_pretrained(path),
                           float64_model(path))  # fmt: skip


def float64_model(path: Path) -> torch.nn.Module:
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float64).eval()


def shapes_image(colour: str, size: tuple[int, int] = (100, 80)) -> Image.Image:
    """A white picture with a circle and a square: small, so 4..16 image tokens."""
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    draw.ellipse((10, 10, 40, 40), fill=colour)
    draw.rectangle((50, 30, 80, 60), fill="black")
    return image


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def user_turn(text: str, images: int) -> list[dict[str, Any]]:
    """One user message with `images` image parts before its text (transformers' form)."""
    return [{"role": "user", "content": [*[{"type": "image"}] * images,
                                         {"type": "text", "text": text}]}]  # fmt: skip


def processor_inputs(vlm: VisionEngine, text: str, images: list[Image.Image]) -> dict[str, Any]:
    """The processor's inputs for a one-turn prompt: ids with the images' tokens expanded."""
    rendered = vlm.processor.apply_chat_template(
        user_turn(text, len(images)), add_generation_prompt=True, tokenize=False
    )
    return vlm.processor(text=[rendered], images=images or None, return_tensors="pt")


def reference_logprobs(
    model: torch.nn.Module, inputs: dict[str, Any], output_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 forward's log-probs of the prompt's tokens after its first (L - 1,) and of
    `output_ids` after the prompt (n,): the processor's `inputs` prefilled, then the outputs
    read as Hugging Face's generation reads them (its KV cache, its own rope deltas). In one
    forward, an image-pad token the model sampled would count as one more image token."""
    model.model.rope_deltas = None  # the model keeps the last prompt's deltas for decoding
    cache = DynamicCache()
    prompt = inputs["input_ids"]
    with torch.no_grad():
        logits = model(**inputs, past_key_values=cache, use_cache=True).logits[0]
        if output_ids:
            more = model(input_ids=torch.tensor([output_ids[:-1]]), past_key_values=cache,
                         use_cache=True).logits[0] if len(output_ids) > 1 else logits[:0]  # fmt: skip
            logits = torch.cat([logits, more])
    ids = torch.cat([prompt[0], torch.tensor(output_ids, dtype=torch.long)])
    log_p = torch.log_softmax(logits[: len(ids) - 1], -1).gather(-1, ids[1:, None]).squeeze(-1)
    return log_p[: prompt.shape[1] - 1], log_p[prompt.shape[1] - 1 :]
