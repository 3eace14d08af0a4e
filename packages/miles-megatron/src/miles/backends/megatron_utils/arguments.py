"""Settings of the Megatron training backend, and the checks that need the model's HF config.

Every field is a user flag (`tensor_model_parallel_size` is `--tensor-model-parallel-size`);
names shared with the FSDP backend mean the same thing there. Settings Megatron would ignore or
reject deep inside model construction raise here, naming the flag and the values (architecture.md: "Design rules").
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Literal

from miles.backends.sglang_utils.vlm_checkpoint import is_vision_language
from miles.config.trainer_args import TrainerArgs

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
"""HF `model_type`s the converters and the local layer spec cover (dense decoders with RMSNorm,
SwiGLU, RoPE and grouped-query attention)."""


@dataclass(kw_only=True)
class MegatronArgs(TrainerArgs):
    """Parallelism and precision settings of the Megatron backend, on top of the shared optimizer,
    schedule and batching settings of `TrainerArgs`."""

    tensor_model_parallel_size: int = 1
    """Ranks that split every layer's weights (attention heads, MLP columns, vocabulary)."""
    pipeline_model_parallel_size: int = 1
    """Ranks that split the layer stack into consecutive stages."""
    context_parallel_size: int = 1
    """Ranks that split every sequence (2 x cp load-balanced chunks each); attention all-gathers
    keys and values over them."""
    expert_model_parallel_size: int = 1
    """Ranks that split the experts of mixture-of-experts layers; 1 for dense models."""
    sequence_parallel: bool = False
    """Split layernorm and dropout activations along the sequence over the tensor-parallel ranks;
    needs --tensor-model-parallel-size > 1."""
    use_distributed_optimizer: bool = True
    """Shard optimizer states and master weights over the data-parallel ranks (ZeRO-1)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times --tensor-model-parallel-size (zero rows,
    never sampled: they are cut off before weights reach the rollout engine)."""
    params_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the model parameters in forward/backward; the optimizer keeps float32 masters."""
    recompute_activations: bool = False
    """Recompute each layer's core attention in the backward pass (Megatron's selective
    recompute): less activation memory for a little more compute."""

    trains_critic: typing.ClassVar[bool] = True
    """--advantage-estimator ppo: the critic is a value model on the policy's ranks and groups."""

    MINIMUMS: typing.ClassVar[dict[str, float]] = {
        **TrainerArgs.MINIMUMS,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "context_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "make_vocab_size_divisible_by": 1,
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_no_lora(self)
        _check_parallel(self)

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model: tensor x pipeline x context parallel."""
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )


def _check_no_lora(args: MegatronArgs) -> None:
    if args.uses_lora:
        raise ValueError(
            f"--lora-rank {args.lora_rank}: the Megatron backend does not train LoRA adapters; "
            "use --train-backend fsdp"
        )


def _check_parallel(args: MegatronArgs) -> None:
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        raise ValueError(
            "--sequence-parallel splits activations over the tensor-parallel ranks, but "
            "--tensor-model-parallel-size is 1, so it would do nothing; drop --sequence-parallel "
            "or raise --tensor-model-parallel-size"
        )


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron's padded vocabulary: the next multiple of `divisible_by * tp_size`, so every
    tensor-parallel rank holds an equal, aligned slice of the embedding and output layer."""
    if vocab_size < 1 or divisible_by < 1 or tp_size < 1:
        raise ValueError(
            f"padded_vocab_size needs positive sizes, got vocab_size={vocab_size}, "
            f"divisible_by={divisible_by}, tp_size={tp_size}"
        )
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def validate_against_hf(args: MegatronArgs, hf_config: Any, world_size: int) -> None:
    """Raise a ValueError if `args` cannot train the model of `hf_config` on `world_size` ranks.

    Checks what Megatron would otherwise assert on mid-construction (sizes the parallel axes must
    divide) and what it would silently ignore (expert parallelism on a dense model).
    """
    model_type = getattr(hf_config, "model_type", None)
    _check_model_family(hf_config)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"the Megatron backend does not support HF model_type {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (or use the FSDP backend, which trains any "
            "transformers model)"
        )
    _check_unsupported_features(hf_config)
    _check_tensor_parallel(args, hf_config)
    layers = hf_config.num_hidden_layers
    pp = args.pipeline_model_parallel_size
    if layers % pp:
        raise ValueError(
            f"--pipeline-model-parallel-size ({pp}) must divide the model's num_hidden_layers "
            f"({layers}) so every stage gets the same number of layers; use one of "
            f"{_divisors(layers)}"
        )
    ep = args.expert_model_parallel_size
    if ep > 1 and not _num_experts(hf_config):
        raise ValueError(
            f"--expert-model-parallel-size {ep} has no effect: {model_type} is a dense model "
            "with no experts; use --expert-model-parallel-size 1"
        )
    if world_size < 1:
        raise ValueError(f"the training world size must be >= 1, got {world_size}")
    mp = args.model_parallel_size
    if world_size % mp:
        raise ValueError(
            f"the {world_size} training ranks must be a multiple of --tensor-model-parallel-size "
            f"x --pipeline-model-parallel-size x --context-parallel-size "
            f"({args.tensor_model_parallel_size} x {pp} x {args.context_parallel_size} = {mp}); "
            f"the rest is data parallel: use {mp * max(1, world_size // mp)} ranks or smaller "
            "parallel sizes"
        )


_GDN_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
"""Hybrids of Gated DeltaNet (linear attention) and full-attention layers."""


def _check_model_family(hf_config: Any) -> None:
    """Refuse, in one line naming the FSDP backend, the families the local layer spec cannot
    build: vision-language models, Gated DeltaNet hybrids and Mixture-of-Experts models (their converters, expert
    routing and linear-attention layers are not written here)."""
    model_type = getattr(hf_config, "model_type", None)
    layer_types = getattr(hf_config, "layer_types", None) or ()
    if model_type in _GDN_MODEL_TYPES or "linear_attention" in layer_types:
        raise ValueError(
            f"the Megatron backend does not train Gated DeltaNet hybrids ({model_type}); use "
            "--train-backend fsdp"
        )
    experts = _num_experts(getattr(hf_config, "text_config", None) or hf_config)
    if experts or (model_type or "").endswith("_moe"):
        raise ValueError(
            f"the Megatron backend does not train Mixture-of-Experts models ({model_type}, "
            f"{experts} experts); use --train-backend fsdp"
        )
    if is_vision_language(hf_config):
        raise ValueError(
            f"the Megatron backend does not train vision-language models ({model_type}); use "
            "--train-backend fsdp"
        )


def _check_tensor_parallel(args: MegatronArgs, hf_config: Any) -> None:
    tp = args.tensor_model_parallel_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    ffn = hf_config.intermediate_size
    valid = _divisors(heads, kv_heads, ffn)
    # Megatron splits attention by whole query groups (each rank needs its own k/v heads), the
    # MLP by columns of gate and of up, so each size must split evenly over tp.
    for what, size in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv_heads),
        ("intermediate_size", ffn),
    ):
        if size % tp:
            raise ValueError(
                f"--tensor-model-parallel-size ({tp}) must divide the model's {what} ({size}); "
                f"use one of {valid}"
            )


def _check_unsupported_features(hf_config: Any) -> None:
    model_type = hf_config.model_type
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(
            f"this {model_type} config sets use_sliding_window=True; the Megatron backend has "
            "only full causal attention; use the FSDP backend or a config without it"
        )
    # Megatron has one bias switch for all four linear layers and one for q/k/v only; Qwen2's
    # always-on q/k/v bias maps to the latter, nothing maps to Llama's o_proj or MLP biases.
    for name in ("attention_bias", "mlp_bias"):
        if model_type != "qwen2" and getattr(hf_config, name, False):
            raise ValueError(
                f"this {model_type} config sets {name}=True, which the Megatron converters do "
                "not support; use the FSDP backend for this model"
            )


def _num_experts(hf_config: Any) -> int:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    return 0


def _divisors(*sizes: int) -> list[int]:
    """The numbers that divide every one of `sizes`."""
    return [d for d in range(1, min(sizes) + 1) if all(s % d == 0 for s in sizes)]
