"""Settings of the Megatron training backend, and the checks that need the model's HF config.

Every field is a user flag (`tensor_model_parallel_size` is `--tensor-model-parallel-size`);
names shared with the FSDP backend mean the same thing there. Settings Megatron would ignore or
reject deep inside model construction raise here, naming the flag and the values (DESIGN §8).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import typing
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
"""HF `model_type`s the converters and the local layer spec cover (dense decoders with RMSNorm,
SwiGLU, RoPE and grouped-query attention)."""


@dataclass(kw_only=True)
class MegatronArgs:
    """Parallelism, optimizer, schedule, batching and precision settings of the Megatron backend."""

    tensor_model_parallel_size: int = 1
    """Ranks that split every layer's weights (attention heads, MLP columns, vocabulary)."""
    pipeline_model_parallel_size: int = 1
    """Ranks that split the layer stack into consecutive stages."""
    context_parallel_size: int = 1
    """Ranks that split one sequence; above 1 needs Transformer Engine's attention."""
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
    lr: float = 1e-6
    """Peak learning rate (after warmup)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay; needs a decaying --lr-decay-style."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW first-moment decay."""
    adam_beta2: float = 0.98
    """AdamW second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW denominator epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    lr_decay_style: Literal["constant", "linear", "cosine", "wsd"] = "constant"
    """Shape of the learning rate after warmup (wsd: warmup-stable-decay)."""
    lr_warmup_iters: int = 0
    """Optimizer steps of linear warmup from 0 to --lr."""
    lr_decay_iters: int | None = None
    """Optimizer step at which the rate reaches --min-lr (warmup included); None: the backend
    uses the total number of optimizer steps of the run."""
    lr_wsd_decay_iters: int | None = None
    """Length of the final decay phase of --lr-decay-style wsd, in optimizer steps."""
    micro_batch_size: int = 1
    """Samples per forward/backward pass when --use-dynamic-batch-size is off."""
    use_dynamic_batch_size: bool = False
    """Pack micro-batches up to --max-tokens-per-gpu tokens instead of a fixed sample count."""
    max_tokens_per_gpu: int | None = None
    """Token budget of one micro-batch per GPU; required by, and only used with,
    --use-dynamic-batch-size."""
    update_weight_buffer_size: int = 512 * 2**20
    """Bytes of gathered parameters per bucket when pushing weights to the rollout engines."""
    use_rollout_logprobs: bool = False
    """Use the engine's log-probs as the old policy instead of recomputing them in the trainer."""
    seed: int = 1234
    """Seed of model initialisation and every random number generator of the trainer."""

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_ranges(self)
        _check_parallel(self)
        _check_schedule(self)
        _check_batching(self)

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model: tensor x pipeline x context parallel."""
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_choices(args: MegatronArgs) -> None:
    hints = typing.get_type_hints(MegatronArgs)
    for f in dataclasses.fields(args):
        annotation: Any = hints[f.name]
        choices = get_args(annotation) if get_origin(annotation) is Literal else ()
        value = getattr(args, f.name)
        if choices and value not in choices:
            raise ValueError(
                f"{_flag(f.name)} {value!r} is not a valid choice; use one of {', '.join(choices)}"
            )


def _check_ranges(args: MegatronArgs) -> None:
    minimums = {
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "context_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "make_vocab_size_divisible_by": 1,
        "lr": 0.0,
        "min_lr": 0.0,
        "weight_decay": 0.0,
        "clip_grad": 0.0,
        "lr_warmup_iters": 0,
        "micro_batch_size": 1,
        "update_weight_buffer_size": 1,
    }
    for name, minimum in minimums.items():
        if getattr(args, name) < minimum:
            raise ValueError(f"{_flag(name)} must be >= {minimum}, got {getattr(args, name)}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(args, name) < 1.0:
            raise ValueError(f"{_flag(name)} must be in [0, 1), got {getattr(args, name)}")
    if args.adam_eps <= 0:
        raise ValueError(f"--adam-eps must be > 0, got {args.adam_eps}")
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr ({args.min_lr}) must not exceed --lr ({args.lr})")


def _check_parallel(args: MegatronArgs) -> None:
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        raise ValueError(
            "--sequence-parallel splits activations over the tensor-parallel ranks, but "
            "--tensor-model-parallel-size is 1, so it would do nothing; drop --sequence-parallel "
            "or raise --tensor-model-parallel-size"
        )
    cp = args.context_parallel_size
    # Megatron's local DotProductAttention asserts cp == 1; only TE's attention splits sequences.
    if cp > 1 and importlib.util.find_spec("transformer_engine") is None:
        raise ValueError(
            f"--context-parallel-size {cp} needs Transformer Engine's attention, and "
            "transformer_engine is not installed; install it or use --context-parallel-size 1"
        )


def _check_schedule(args: MegatronArgs) -> None:
    style = args.lr_decay_style
    if style == "constant":
        for name, value in (("min_lr", args.min_lr), ("lr_decay_iters", args.lr_decay_iters)):
            if value not in (None, 0.0):
                raise ValueError(
                    f"{_flag(name)} ({value}) has no effect with --lr-decay-style constant; "
                    "drop it or choose linear, cosine or wsd"
                )
    if style != "wsd" and args.lr_wsd_decay_iters is not None:
        raise ValueError(
            f"--lr-wsd-decay-iters ({args.lr_wsd_decay_iters}) only applies to --lr-decay-style "
            f"wsd, not {style}; drop it or use --lr-decay-style wsd"
        )
    if style == "wsd" and args.lr_wsd_decay_iters is None:
        raise ValueError(
            "--lr-decay-style wsd needs --lr-wsd-decay-iters (steps of the final decay phase)"
        )
    if args.lr_wsd_decay_iters is not None and args.lr_wsd_decay_iters < 1:
        raise ValueError(f"--lr-wsd-decay-iters must be >= 1, got {args.lr_wsd_decay_iters}")
    if args.lr_decay_iters is not None and args.lr_decay_iters <= args.lr_warmup_iters:
        raise ValueError(
            f"--lr-decay-iters ({args.lr_decay_iters}) must exceed --lr-warmup-iters "
            f"({args.lr_warmup_iters}): decay starts after warmup"
        )


def _check_batching(args: MegatronArgs) -> None:
    if args.use_dynamic_batch_size and args.max_tokens_per_gpu is None:
        raise ValueError(
            "--use-dynamic-batch-size needs --max-tokens-per-gpu (the token budget of one "
            "micro-batch); set it, e.g. --max-tokens-per-gpu 8192"
        )
    if not args.use_dynamic_batch_size and args.max_tokens_per_gpu is not None:
        raise ValueError(
            f"--max-tokens-per-gpu ({args.max_tokens_per_gpu}) is only used with "
            "--use-dynamic-batch-size; add that flag or drop --max-tokens-per-gpu"
        )
    if args.max_tokens_per_gpu is not None and args.max_tokens_per_gpu < 1:
        raise ValueError(f"--max-tokens-per-gpu must be >= 1, got {args.max_tokens_per_gpu}")


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
