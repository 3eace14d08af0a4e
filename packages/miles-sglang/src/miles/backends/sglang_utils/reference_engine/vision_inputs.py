"""A vision-language model's prompts: images through the checkpoint's own processor
(`AutoProcessor`) into pixel values and grid sizes, the prompt's image tokens checked against the
grids, and each image's content hash, which keys prefix sharing.

Two prompt forms, as SGLang: text with one unexpanded image placeholder per image (the processor
expands each to one token per merged patch), or input_ids the processor already expanded (what
miles' rollouts send). No resizing or patching is written here: the processor does all of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor
from transformers import AutoProcessor, PretrainedConfig

from miles.backends.sglang_utils.reference_engine.errors import InvalidRequestError


@dataclass(frozen=True, eq=False)
class PromptImages:
    """The images of one prompt, in the order their tokens appear in it."""

    pixel_values: Tensor
    """(patches, channels * temporal_patch * patch * patch), the processor's output."""
    grid_thw: Tensor
    """(images, 3): each image's temporal, height and width patch counts."""
    token_counts: tuple[int, ...]
    """Each image's tokens in the prompt: its patches over the merge (2x2 in Qwen-VL)."""
    hashes: tuple[int, ...]
    """Each image's content hash (its pixel values and grid): the same image, the same hash."""
    token_id: int
    """The image-pad token id that stands for the images in the prompt."""

    def prefix_key(self, ids: Sequence[int]) -> tuple[int, ...]:
        """`ids` with each image's tokens replaced by its hash (negative: never a token id), as
        SGLang pads image tokens with a hash of the image before matching prefixes: two prompts
        share KV only when their ids and their images both agree."""
        key, image, left = [], -1, 0
        for token in ids:
            if token != self.token_id:
                key.append(token)
                continue
            if left == 0:  # the first token of the next image (two images may be adjacent)
                image += 1
                left = self.token_counts[image]
            key.append(-1 - self.hashes[image])
            left -= 1
        return tuple(key)


class VisionProcessor:
    """The checkpoint's processor, and what a prompt with images becomes before it is queued."""

    def __init__(self, model_path: str | Path, config: PretrainedConfig) -> None:
        self.processor = AutoProcessor.from_pretrained(model_path)
        self.token_id: int = config.image_token_id
        self.placeholder: str = self.processor.image_token
        self.merge: int = config.vision_config.spatial_merge_size

    def read(
        self, prompt: str | list[int], images: list[Image.Image], param: str
    ) -> tuple[list[int], PromptImages | None]:
        """The prompt's token ids and images. `prompt` is text with one placeholder per image,
        or ids already expanded; `param` names the image field in errors."""
        if isinstance(prompt, str):
            return self._expand_text(prompt, images, param)
        return list(prompt), self._for_ids(prompt, images, param)

    def _expand_text(
        self, text: str, images: list[Image.Image], param: str
    ) -> tuple[list[int], PromptImages | None]:
        placeholders = text.count(self.placeholder)
        if placeholders != len(images):
            raise InvalidRequestError(
                f"the text holds {placeholders} {self.placeholder} placeholder(s) for "
                f"{len(images)} image(s) in {param}: write one placeholder per image "
                "(<|vision_start|><|image_pad|><|vision_end|>, as the chat template does) and the "
                "engine expands it; already expanded prompts go in input_ids",
                param=param,
            )
        try:
            inputs = self.processor(
                text=[text], images=images or None, add_special_tokens=False, return_tensors="pt"
            )
        except Exception as err:  # the processor's own checks (aspect ratio, sizes)
            raise _unprocessable(param, err) from None
        ids = inputs["input_ids"][0].tolist()
        if not images:
            return ids, None
        return ids, self._prompt_images(inputs["pixel_values"], inputs["image_grid_thw"])

    def _for_ids(
        self, ids: Sequence[int], images: list[Image.Image], param: str
    ) -> PromptImages | None:
        tokens = sum(1 for token in ids if token == self.token_id)
        if not images and not tokens:
            return None
        found = None
        if images:
            try:
                found = self.processor.image_processor(images=images, return_tensors="pt")
            except Exception as err:
                raise _unprocessable(param, err) from None
            found = self._prompt_images(found["pixel_values"], found["image_grid_thw"])
        expected = sum(found.token_counts) if found else 0
        if tokens != expected:
            grids = (
                ", ".join("x".join(map(str, g)) for g in found.grid_thw.tolist()) if found else ""
            )
            made = f"make {expected} (patch grids {grids}, merged {self.merge}x{self.merge})"
            raise InvalidRequestError(
                f"input_ids hold {tokens} image tokens ({self.placeholder}, id {self.token_id}) "
                f"but the {len(images)} image(s) of {param} {made if images else 'make 0'}: send "
                "the processor's input_ids for exactly these images (or text with one "
                f"{self.placeholder} per image)",
                param=param,
            )
        return found

    def _prompt_images(self, pixel_values: Tensor, grid_thw: Tensor) -> PromptImages:
        patches = grid_thw.prod(-1)  # (images,)
        hashes = []
        for pixels, grid in zip(pixel_values.split(patches.tolist()), grid_thw, strict=True):
            digest = hashlib.blake2b(digest_size=8)
            digest.update(grid.numpy().tobytes())
            digest.update(pixels.contiguous().numpy().tobytes())
            hashes.append(int.from_bytes(digest.digest(), "little"))
        return PromptImages(
            pixel_values=pixel_values,
            grid_thw=grid_thw,
            token_counts=tuple((patches // self.merge**2).tolist()),
            hashes=tuple(hashes),
            token_id=self.token_id,
        )


def no_vision_tower(images: int, param: str) -> InvalidRequestError:
    """The refusal of `images` images (in `param`) by a text model."""
    return InvalidRequestError(
        f"{param} gives {images} image(s), but the served model has no vision tower (it reads "
        "text only): send text only, or serve a vision-language model (Qwen2.5-VL, Qwen3-VL)",
        param=param,
    )


def _unprocessable(param: str, err: Exception) -> InvalidRequestError:
    return InvalidRequestError(
        f"the model's image processor refused the images of {param}: {type(err).__name__}: {err}",
        param=param,
    )


def batch_pixels(images: Sequence[PromptImages | None]) -> dict[str, Tensor]:
    """The forward's image inputs for prompts in batch order (rows without images add none):
    `pixel_values` and `image_grid_thw`, or {} when no prompt has an image."""
    present = [i for i in images if i is not None]
    if not present:
        return {}
    return {
        "pixel_values": torch.cat([i.pixel_values for i in present]),
        "image_grid_thw": torch.cat([i.grid_thw for i in present]),
    }
