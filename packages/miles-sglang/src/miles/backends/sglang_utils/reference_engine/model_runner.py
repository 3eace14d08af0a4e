"""A Hugging Face causal LM run as prefill and decode steps over a running batch (its KV cache:
`batch_cache`). Prefills and decode steps of dense Llama-layout models skip the HF forward
(`fast_decode`). With LoRA serving, each row runs with its own adapter (`lora_layers`) on either
path. A vision-language model's prefill reads its prompts' images (`vision_inputs`) and its rows
decode at their multimodal rotary positions (`mrope`)."""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import TypeVar

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from miles.backends.sglang_utils.reference_engine.attention import use_grouped_sdpa
from miles.backends.sglang_utils.reference_engine.batch_cache import (
    BatchState,
    append_kv,
    gather_rows,
)
from miles.backends.sglang_utils.reference_engine.fast_decode import DenseDecoder
from miles.backends.sglang_utils.reference_engine.lora_layers import LoraAdapter, LoraLayers
from miles.backends.sglang_utils.reference_engine.mrope import MropePositions
from miles.backends.sglang_utils.reference_engine.routed_experts import RoutedExpertsRecorder
from miles.backends.sglang_utils.reference_engine.vision_inputs import PromptImages, batch_pixels
from miles.backends.sglang_utils.reference_engine.weight_layout import transpose_linear_weights
from miles.backends.sglang_utils.vlm_checkpoint import is_vision_language

logger = logging.getLogger(__name__)
T = TypeVar("T")


class _AppendingLayer(DynamicLayer):
    """A cache layer that appends a step's keys and values in place where its buffer has room."""

    def __init__(self, keys: Tensor, values: Tensor) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        self.keys = append_kv(self.keys, key_states)
        self.values = append_kv(self.values, value_states)
        return self.keys, self.values


def distinct_prompts(
    prompts: list[list[int]],
    adapters: list[LoraAdapter | None] | None = None,
    images: list[PromptImages | None] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """(the distinct prompts in first-seen order, each prompt's row among them). With `adapters`
    (one per prompt), a prompt is shared only with prompts of the same adapter: KV computed
    through an adapter is not the base model's, nor another adapter's. With `images` (one per
    prompt, None for a text prompt), a prompt is shared only with prompts of the same images: the
    image tokens' ids are the same for every image, so they are keyed by the images' content
    (`PromptImages.prefix_key`)."""
    count = len(prompts)
    first_row: dict[tuple[LoraAdapter | None, tuple[int, ...]], int] = {}
    distinct: list[list[int]] = []
    rows = []
    for prompt, adapter, image in zip(
        prompts, adapters or [None] * count, images or [None] * count, strict=True
    ):
        key = tuple(prompt) if image is None else image.prefix_key(prompt)
        row = first_row.setdefault((adapter, key), len(first_row))
        if row == len(distinct):
            distinct.append(list(prompt))
        rows.append(row)
    return distinct, rows


def _of_distinct(
    values: list[T | None] | None, rows: list[int], count: int
) -> list[T | None] | None:
    """The value (adapter, images) of each of `count` distinct prompts, from the rows that map
    onto them; None when every row has None."""
    if values is None or all(value is None for value in values):
        return None
    distinct: list[T | None] = [None] * count
    for value, row in zip(values, rows, strict=True):
        distinct[row] = value
    return distinct


def check_kv_only(model: torch.nn.Module) -> None:
    """Refuse a model whose layers keep a recurrent state (Gated DeltaNet in Qwen3.5 and
    Qwen3-Next, Mamba, ...): `BatchState` holds per-layer KV tensors only, and joining or dropping
    rows would lose or mix those states."""
    if getattr(model, "_is_stateful", False):
        config = model.config
        name = ", ".join(getattr(config, "architectures", None) or [type(model).__name__])
        raise ValueError(
            f"the reference engine cannot serve {name} (model_type {config.model_type!r}): its "
            "linear-attention / state-space layers keep a recurrent state that the engine's KV "
            "batch cache does not hold; serve it with SGLang (--rollout-engine sglang)"
        )


class ModelRunner:
    """Prefill and decode for one model on one device, with no autograd."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        *,
        record_routed_experts: bool = False,
        fast_decode: bool = True,
        lora: bool = False,
    ) -> None:
        """`fast_decode`: run prefills and decode steps through `DenseDecoder` where the model
        allows it (False: always the HF forward, as for checks against it). `lora`: rows may
        carry LoRA adapters (`prefill`'s `adapters`)."""
        check_kv_only(model)
        self.model = model.eval().to(device)
        self.device = device
        transpose_linear_weights(self.model, device)
        self.lora = LoraLayers(self.model, device) if lora else None
        self.recorder = RoutedExpertsRecorder(self.model) if record_routed_experts else None
        self.prefill_routed: list[Tensor] = []
        """With a recorder: after a prefill, each prompt's (len(prompt), layers, top_k) experts."""
        self.decode_routed: Tensor | None = None
        """With a recorder: after a decode step, each row's (layers, top_k) experts of the token
        it read."""
        self.mrope = MropePositions(self.model) if is_vision_language(model.config) else None
        """For a vision-language model: its prompts' 3-D rotary positions; None for text."""
        use_grouped_sdpa(self.model, device)
        # transformers 5 renamed the cache argument; accept either spelling.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._keeps_logits = "logits_to_keep" in params
        self.prefilled_tokens = 0
        """Prompt tokens run through the model (shared prompts count once)."""
        self.decoder: DenseDecoder | None = None
        why = "turned off" if not fast_decode else "routed experts are recorded by the HF forward"
        if fast_decode and self.recorder is None:
            self.decoder, why = DenseDecoder.for_model(self.model, self.lora)
        if self.lora is not None:
            self.lora.hook_hf_forward()  # after the decoder's check of the model's hooks
        logger.info(
            "prefill and decode: %s", "fast path" if self.decoder else f"HF forward ({why})"
        )

    def _forward(
        self, input_ids: Tensor, mask: Tensor, positions: Tensor, cache: DynamicCache,
        *, every_position: bool = True, pixels: dict[str, Tensor] | None = None,
    ) -> Tensor:  # fmt: skip
        """The logits (B, S, V), or without `every_position` (B, 1, V) where the model's forward
        can leave the other positions out of its output head (`logits_to_keep`). `pixels`: a
        vision-language prefill's `pixel_values` and `image_grid_thw`."""
        keep = {} if every_position or not self._keeps_logits else {"logits_to_keep": 1}
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_kwarg: cache},
            **keep,
            **(pixels or {}),
        )
        return out.logits

    @staticmethod
    def _state_from(
        cache: DynamicCache,
        mask: Tensor,
        adapters: list[LoraAdapter | None] | None,
        rope_deltas: Tensor | None,
    ) -> BatchState:
        keys = [layer.keys for layer in cache.layers]
        values = [layer.values for layer in cache.layers]
        return BatchState(keys, values, mask, adapters, rope_deltas)

    def _adapted(
        self, adapters: list[LoraAdapter | None] | None
    ) -> contextlib.AbstractContextManager[None]:
        """Run the forward inside it with each row's adapter."""
        if adapters is None:
            return contextlib.nullcontext()
        assert self.lora is not None, "rows carry LoRA adapters on a runner built without lora"
        return self.lora.batch(adapters)

    def prefill(
        self,
        prompts: list[list[int]],
        adapters: list[LoraAdapter | None] | None = None,
        images: list[PromptImages | None] | None = None,
    ) -> tuple[Tensor, BatchState]:
        """Logits of each prompt's last position (B, V) and the left-padded cache of all prompts,
        each run with its LoRA adapter in `adapters` (None: the base model) and its images in
        `images` (None: a text prompt).

        A prompt that occurs several times (a GRPO group's n samples arrive together) is computed
        once and its cache rows copied: its forward would give the same numbers again."""
        logits, state, _ = self.prefill_with_prompt_logits(
            prompts, [False] * len(prompts), adapters, images
        )
        return logits, state

    @torch.no_grad()
    def prefill_with_prompt_logits(
        self,
        prompts: list[list[int]],
        wanted: list[bool],
        adapters: list[LoraAdapter | None] | None = None,
        images: list[PromptImages | None] | None = None,
    ) -> tuple[Tensor, BatchState, list[Tensor | None]]:
        """As `prefill`, and the logits at every position, (len(prompt), V) in the model's dtype,
        of each prompt i with `wanted[i]` (None for the others): the forward computes them all
        anyway, so scoring a prompt costs no extra forward."""
        assert self.mrope is not None or not any(images or []), "images for a text-only model"
        distinct, rows = distinct_prompts(prompts, adapters, images)
        row_adapters = _of_distinct(adapters, rows, len(distinct))
        row_images = _of_distinct(images, rows, len(distinct))
        with self._recording(len(distinct), max(len(p) for p in distinct)) as routed:
            # (B, L or 1, V)
            every, state = self._prefill(
                distinct, row_adapters, row_images, every_position=any(wanted)
            )
        self.prefilled_tokens += sum(len(prompt) for prompt in distinct)
        length = state.length
        if routed:  # (B, L, layers, top_k), left-padded like the prompts
            self.prefill_routed = [
                routed[0][row, length - len(prompt) :]
                for prompt, row in zip(prompts, rows, strict=True)
            ]
        prompt_logits = [
            every[row, length - len(prompt) :] if want else None
            for prompt, row, want in zip(prompts, rows, wanted, strict=True)
        ]
        logits = every[:, -1, :]
        if len(distinct) == len(prompts):
            return logits, state, prompt_logits
        return *gather_rows(logits, state, rows), prompt_logits

    def _prefill(
        self,
        prompts: list[list[int]],
        adapters: list[LoraAdapter | None] | None,
        images: list[PromptImages | None] | None,
        *,
        every_position: bool,
    ) -> tuple[Tensor, BatchState]:
        """The logits at every (left-padded) position, (B, L, V), or with `every_position`
        False at least those of the last one, and the cache."""
        length = max(len(p) for p in prompts)
        input_ids = torch.zeros(len(prompts), length, dtype=torch.long)
        mask = torch.zeros(len(prompts), length, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, length - len(prompt) :] = torch.tensor(prompt)
            mask[row, length - len(prompt) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        pixels: dict[str, Tensor] = {}
        deltas = None
        if self.mrope is not None:
            pixels = {k: v.to(self.device) for k, v in batch_pixels(images or []).items()}
            # (3, B, L), or (B, L) when no prompt has an image; (B,)
            positions, deltas = self.mrope.prefill(input_ids, mask, pixels.get("image_grid_thw"))
        else:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, L)
        with self._adapted(adapters):
            if self.decoder is not None:
                logits, keys, values = self.decoder.prefill(
                    input_ids, mask, positions, every_position=every_position
                )
                return logits, BatchState(keys, values, mask, adapters)
            cache = DynamicCache()
            logits = self._forward(input_ids, mask, positions, cache,
                                   every_position=every_position, pixels=pixels)  # fmt: skip
            return logits, self._state_from(cache, mask, adapters, deltas)

    @torch.no_grad()
    def decode(self, state: BatchState, tokens: list[int]) -> tuple[Tensor, BatchState]:
        """Feed one new token per row; logits (B, V) for the next token and the grown state."""
        positions = state.mask.sum(-1)  # (B,): the next real position per row
        if state.rope_deltas is not None:  # after images, a row's positions lag its length
            positions = positions + state.rope_deltas
        mask = torch.cat([state.mask, state.mask.new_ones(state.size, 1)], dim=1)  # (B, L+1)
        input_ids = torch.tensor(tokens, device=self.device)  # (B,)
        if self.decoder is not None:
            with self._adapted(state.adapters):
                logits, keys, values = self.decoder.step(
                    input_ids, positions, mask, state.keys, state.values
                )
            return logits, BatchState(keys, values, mask, state.adapters)
        cache = DynamicCache()
        cache.layers = [
            _AppendingLayer(k, v) for k, v in zip(state.keys, state.values, strict=True)
        ]
        with self._recording(len(tokens), 1) as routed, self._adapted(state.adapters):
            logits = self._forward(input_ids[:, None], mask, positions[:, None], cache)
        if routed:
            self.decode_routed = routed[0][:, 0]  # (B, layers, top_k)
        return logits[:, -1, :], self._state_from(cache, mask, state.adapters, state.rope_deltas)

    def _recording(self, rows: int, columns: int) -> contextlib.AbstractContextManager[list]:
        if self.recorder is None:
            return contextlib.nullcontext([])
        return self.recorder.recording(rows, columns)

    @torch.no_grad()
    def score(self, token_ids: list[int], temperature: float = 1.0) -> Tensor:
        """Teacher-forced log-probs of tokens[1:] given their prefixes, (T-1,), for checks."""
        ids = torch.tensor([token_ids], device=self.device)
        logits = self.model(input_ids=ids).logits[0, :-1].float() / temperature
        return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
