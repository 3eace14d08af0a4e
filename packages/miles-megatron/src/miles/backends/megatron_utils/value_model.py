"""PPO's value model (the critic) on Megatron: a GPTModel whose vocabulary output layer is replaced
by a one-output linear head, its start weights, and its values per micro-batch.

It is what transformers' `AutoModelForTokenClassification(num_labels=1)` computes (decoder, final
norm, `score`), which the FSDP backend's critic trains, and it reads and writes the same `score`
tensors. The head is one row: too small to split, so every tensor-parallel rank holds all of it
(see `ValueHead`); with pipeline parallelism the last stage holds it. Nothing drops out: the
FSDP critic turns transformers' classifier dropout off too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule
from torch import Tensor, nn
from transformers import AutoModelForTokenClassification

from miles.backends.megatron_utils.context_parallel import gather_sequence
from miles.backends.megatron_utils.forward import MicroBatchForward
from miles.backends.training_utils.batching.rollout_data import RolloutBatch

VALUE_HEAD_PREFIX = "score."
"""The HF names of the head: `score.weight` (1, hidden) and, where the config asks, `score.bias`."""


def value_head_has_bias(hf_config: Any) -> bool:
    """Whether the HF model's `score` has a bias: transformers' rule for token classification
    (`GenericForTokenClassification`), so that checkpoints pass between the two unchanged."""
    return bool(getattr(hf_config, "token_classification_bias", True))


class ValueHead(nn.Module):
    """The value model's output layer, put in a GPTModel's `output_layer` slot: final hidden
    states [S, B, H] -> values [S, B, 1], returned as `(values, None)` like Megatron's
    column-parallel output layer.

    Replicated over tensor-parallel ranks. Its input, the final norm's output, is whole and equal
    on every rank (the last layer's row-parallel projections all-reduce), so every rank computes
    the same values and the same loss, and the gradient it sends back is the whole gradient of
    the hidden states, which is what each rank's row-parallel backward needs. A vocabulary-
    parallel layer instead sends partial gradients, which its input's tensor-parallel region
    sums; nothing may sum here. Its parameters carry no `tensor_model_parallel` mark, so
    Megatron counts them once (on tensor-parallel rank 0) in the gradient norm, as it does the
    layer norms, and no `sequence_parallel` mark, so no all-reduce sums their gradients over
    the tensor-parallel ranks.
    """

    def __init__(self, config: Any, *, bias: bool) -> None:
        super().__init__()
        if config.sequence_parallel:
            # The final hidden states would be split along the sequence; the backend refuses
            # --sequence-parallel (transformer_config_from_hf), so this never builds.
            raise ValueError("the value head reads whole sequences; drop --sequence-parallel")
        # Where Megatron puts its own layers' parameters (the device the engine then moves to).
        self.score = nn.Linear(
            config.hidden_size, 1, bias=bias, dtype=config.params_dtype,
            device=torch.cuda.current_device(),
        )  # fmt: skip
        # Overwritten by the checkpoint's (or a seeded draw, `value_model_state`) when loaded.
        config.init_method(self.score.weight)
        if bias:
            nn.init.zeros_(self.score.bias)

    def forward(
        self, hidden_states: Tensor, weight: Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[Tensor, None]:
        return self.score(hidden_states), None  # (S, B, 1)


class GPTValueModel(GPTModel):
    """A GPTModel (same arguments, nothing tied to the embedding) whose last pipeline stage ends
    in a `ValueHead`: its forward returns values [B, T, 1] where GPTModel returns logits."""

    def __init__(self, *, value_head_bias: bool, **gpt_model_args: Any) -> None:
        super().__init__(**gpt_model_args, share_embeddings_and_output_weights=False)
        if self.post_process:
            # GPTModel always builds its vocabulary output layer; its memory is freed here.
            self.output_layer = ValueHead(self.config, bias=value_head_bias)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        # Megatron's language-model override marks `output_layer.weight` for vocabulary padding,
        # which a value head has none of (nor a weight of that name); what it adds beyond
        # MegatronModule's default is for tied or multi-token-prediction output layers only.
        return MegatronModule.sharded_state_dict(self, prefix, sharded_offsets, metadata)


def value_model_state(checkpoint: str, hf_config: Any, *, seed: int) -> dict[str, Tensor]:
    """The HF state dict of `checkpoint` as a one-label token-classification model (float32):
    its transformer, and its `score` when it has one (an exported critic). A checkpoint without
    one (a causal LM) gets a new head drawn as transformers draws it (weight ~ N(0,
    initializer_range), bias 0) from a generator seeded by --seed: the same on every rank, with
    no communication."""
    model, info = AutoModelForTokenClassification.from_pretrained(
        checkpoint, config=hf_config, dtype=torch.float32, output_loading_info=True
    )
    missing = set(info["missing_keys"])
    state = model.state_dict()
    del model
    absent = sorted(name for name in missing if not name.startswith(VALUE_HEAD_PREFIX))
    if absent:
        raise ValueError(
            f"the critic's checkpoint {checkpoint} lacks {absent[:5]}; it must hold a whole "
            f"{hf_config.model_type} transformer (only the value head may be new)"
        )
    if missing:
        generator = torch.Generator().manual_seed(seed)
        std = getattr(hf_config, "initializer_range", 0.02)
        weight = state[VALUE_HEAD_PREFIX + "weight"]
        state[VALUE_HEAD_PREFIX + "weight"] = torch.randn(weight.shape, generator=generator) * std
        if VALUE_HEAD_PREFIX + "bias" in state:
            state[VALUE_HEAD_PREFIX + "bias"] = torch.zeros_like(state[VALUE_HEAD_PREFIX + "bias"])
    return state


class ValueForward(MicroBatchForward):
    """`MicroBatchForward` for the value model: what the loss (and a forward-only pass) reads is
    the value at each position whose logits would predict a response token (the state before
    that token), with zero entropies. With context parallelism the ranks all-gather their
    positions' values (B x T floats), so, as for the policy's log-probs, every context-parallel
    rank computes the whole loss and the gather's backward hands each rank its positions'
    gradient."""

    def response_outputs(
        self,
        output: Tensor,
        micro: RolloutBatch,
        input_ids: Tensor,
        positions: Sequence[Tensor],
        targets: Sequence[Tensor],
    ) -> tuple[Tensor, Tensor, None]:
        values = output[..., 0].float()  # (B, T), or (B, T / cp) of this rank's positions
        if self.cp_size > 1:
            values = gather_sequence(values, 1, self.cp_group)  # (B, T) in global order
        picked = torch.cat(
            [values[row, pos.to(values.device)] for row, pos in enumerate(positions)]
        )  # (sum R,)
        return picked, torch.zeros_like(picked), None
