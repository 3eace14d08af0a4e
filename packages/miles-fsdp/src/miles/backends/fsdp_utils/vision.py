"""Vision-language models on the FSDP backend: their images' pixel inputs and their frozen tower
(their parameters under the checkpoint's names: `sglang_utils.vlm_checkpoint.checkpoint_names`).

(architecture.md: "Contracts / Data", images)

A sample's images travel as SGLang's `image_data` strings (`Sample.images`); its tokens already
hold the processor's image tokens (one per merged patch), so micro-batch budgets, which count
tokens, count them too. Here each image is turned into the processor's pixel values and grid, the
same call the rollout side's processor made, so the policy sees what the engine saw.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from miles.backends.sglang_utils.image_data import decode_image
from miles.backends.training_utils.batching.rollout_data import RolloutBatch

# Processed images kept per rank: a rollout's images are read by the old-policy, reference and
# training forwards of the same step, and a group's samples share their prompt's. Bounded by
# memory, not by a rollout's count: a 1000-patch image's pixel values are about 5 MB in float32,
# so 128 of them cost 0.6 GB; an image past the bound is processed again, a CPU cost only.
_PROCESSED_IMAGES = 128
RESPONSE_IMAGE_STAND_IN = 0
"""The id an image token sampled in a response enters the train forward as (see `of`)."""


class VisionInputs:
    """The pixel inputs of a micro-batch's images, as the checkpoint's processor makes them."""

    def __init__(self, hf_checkpoint: str, config: Any) -> None:
        from transformers import AutoProcessor

        self.image_processor = AutoProcessor.from_pretrained(hf_checkpoint).image_processor
        self.image_token_id = int(config.image_token_id)
        self._process = functools.lru_cache(maxsize=_PROCESSED_IMAGES)(self._process_one)

    def _process_one(self, image: str) -> tuple[Tensor, Tensor]:
        out = self.image_processor(images=[decode_image(image)], return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def of(self, micro: RolloutBatch, rows: Tensor, device: torch.device) -> dict[str, Tensor]:
        """The forward's image keywords for `rows` (B, L), the micro-batch's documents as padded
        rows in order: pixel values and grids of every image, row by row, the token types the
        model's multimodal rotary positions are computed from, and the input ids to run.

        A response may hold the image token as text (a model can sample any id; the engine, as
        SGLang, treats it as text): the model would take it for an image's place and refuse
        the count. Such tokens enter the forward as `RESPONSE_IMAGE_STAND_IN` instead; the
        log-prob of the sampled token itself is unchanged, the later ones in that response
        are conditioned on the stand-in (a model that writes image placeholders is rare, and
        the samples are few)."""
        starts = torch.tensor(
            [t - r for t, r in zip(micro["total_lengths"], micro["response_lengths"], strict=True)],
            device=rows.device,
        )
        columns = torch.arange(rows.shape[1], device=rows.device)
        in_response = columns.unsqueeze(0) >= starts.unsqueeze(1)  # (B, L)
        written = in_response & (rows == self.image_token_id)
        if written.any():
            rows = rows.masked_fill(written, RESPONSE_IMAGE_STAND_IN)
        inputs = {
            "input_ids": rows,
            # 1 marks an image token (transformers' convention; 2 would be video).
            "mm_token_type_ids": (rows == self.image_token_id).int(),
        }
        images = [image for row in micro.get("images", ()) for image in row]
        if not images:
            return inputs
        processed = [self._process(image) for image in images]
        inputs["pixel_values"] = torch.cat([p for p, _ in processed]).to(device)
        inputs["image_grid_thw"] = torch.cat([g for _, g in processed]).to(device)
        return inputs


def idle_tower_term(model: nn.Module, device: torch.device) -> Tensor:
    """Zero, computed through the vision tower on a blank 2x2-patch image: what a forward without
    images adds to its logits.

    Each vision block is an FSDP unit. A rank whose micro-batch has no image would skip their
    all-gathers (and in backward their reduce-scatters) while a rank with images makes them: the
    collectives would pair up wrongly. Run first, this keeps the order of a forward with images;
    its gradients are zeros, so what trains is unchanged."""
    vision = model.config.vision_config
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    merge = vision.spatial_merge_size
    grid = torch.tensor([[1, merge, merge]], device=device)
    pixels = torch.zeros(merge * merge, patch, device=device)
    features = model.get_image_features(pixel_values=pixels, image_grid_thw=grid)
    return 0.0 * sum(t.float().sum() for t in _tensors(features))


def _tensors(value: Any) -> list[Tensor]:
    """Every tensor in a model output (a ModelOutput, tuple or list, nested)."""
    if isinstance(value, Tensor):
        return [value]
    if hasattr(value, "values"):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return []


def vision_tower(model: nn.Module) -> nn.Module:
    """The model's vision encoder (`visual` in Qwen-VL models, wherever the class nests it)."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "visual":
            return module
    raise ValueError(
        f"{type(model).__name__} has no `visual` module: --freeze-vision-tower needs a "
        "Qwen-VL-style model with a vision tower"
    )
