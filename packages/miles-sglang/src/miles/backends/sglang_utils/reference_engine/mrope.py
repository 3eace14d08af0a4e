"""Positions of a vision-language model's prompts under its multimodal rotary embedding (Qwen's
mrope): text tokens advance one position on all three axes (time, height, width), an image's
tokens share one time position and spread over its patch grid, so a prompt with images ends at a
position below its length. Each row keeps that difference (its rope delta) for its decode steps.

The model computes the positions itself (`get_rope_index`); this module only feeds it the
left-padded batch, and leaves text-only batches to the model's own 1-D positions.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class MropePositions:
    """Prefill positions and rope deltas of one model with a vision tower."""

    def __init__(self, model: nn.Module) -> None:
        self._rope_index = model.model.get_rope_index
        self.image_token_id: int = model.config.image_token_id

    def prefill(
        self, input_ids: Tensor, mask: Tensor, image_grid_thw: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Positions of left-padded prompts `input_ids` (B, L) whose `mask` marks real tokens,
        the images' grids in prompt order: (3, B, L), or (B, L) when no prompt has an image (the
        model puts them on all three axes), and each row's rope delta (B,)."""
        if image_grid_thw is None:
            return (mask.cumsum(-1) - 1).clamp(min=0), mask.new_zeros(mask.shape[0])
        positions, deltas = self._rope_index(
            input_ids,
            mm_token_type_ids=(input_ids == self.image_token_id).int(),  # 1: image, 0: text
            image_grid_thw=image_grid_thw.to(input_ids.device),
            attention_mask=mask,
        )
        return positions, deltas.view(-1).to(torch.long)
