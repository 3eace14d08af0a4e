"""Settings of the FSDP training backend: one dataclass, the `backend` group of the run's config.

Every field is a user flag (`lr_decay_style` is `--lr-decay-style`), read from YAML and the
command line by the run's config loader (`miles.config.load_config`), like every other group.
Settings this backend cannot honour raise at load time, naming the flag, instead of being silently
ignored (architecture.md: "Design rules").
"""

from __future__ import annotations

import importlib.util
import logging
import typing
from dataclasses import dataclass
from typing import Literal

from miles.config.trainer_args import TrainerArgs

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class FSDPArgs(TrainerArgs):
    """Parallelism and precision settings of the FSDP backend, on top of the shared optimizer,
    schedule and batching settings of `TrainerArgs`."""

    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    fsdp_cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer states in host memory (FSDP2 offload)."""
    fsdp_gather: Literal["auto", "micro_batch", "step"] = "auto"
    """How often a rank gathers each layer's full parameters and reduces its gradients.
    micro_batch (ZeRO-3, least memory): two all-gathers and one reduce-scatter per micro-batch.
    step (ZeRO-2 within a step): gathered once per optimizer step and kept through every
    micro-batch's forward and backward, gradients accumulated whole and reduce-scattered once; a
    rank holds the full parameters and gradients during the step (as DDP does), its optimizer
    state stays sharded. auto: step on CPU, where gloo moves every byte through host memory;
    micro_batch on accelerators."""
    dp_replicate_size: int = 1
    """HSDP replicas: shard within groups of world/replicas ranks, replicate across groups."""
    context_parallel_size: int = 1
    """Ranks that split one sequence; the FSDP backend supports only 1 for now."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """transformers attention kernel of the trained model."""
    freeze_vision_tower: bool = False
    """A vision-language model trains its language model only: the vision encoder's weights stay
    as the checkpoint has them (no gradients, no optimizer state)."""
    share_prompt_forward: bool = True
    """Forward a prompt once for all the samples of a micro-batch that share it (a GRPO group),
    each response attending to its KV cache, instead of once per sample: the same log-probs and
    gradients for fewer tokens. Applies with sdpa or eager attention to dense full-attention
    models without gradient checkpointing; elsewhere every sample forwards its own prompt (the
    train actor logs which)."""
    moe_aux_loss_coef: float | None = None
    """MoE models: weight of the load-balancing loss (E x sum over experts of the share of tokens
    routed there x its mean router probability, averaged over layers) added to every train step;
    default the checkpoint's `router_aux_loss_coef`, 0 turns it off."""
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of parameters in forward/backward; auto: bfloat16 on accelerators, float32
    on CPU. Master weights and optimizer states stay float32."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of gradient reduce-scatter / all-reduce."""

    trains_critic: typing.ClassVar[bool] = True

    MINIMUMS: typing.ClassVar[dict[str, float]] = {
        **TrainerArgs.MINIMUMS,
        "dp_replicate_size": 1,
        "context_parallel_size": 1,
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_unsupported(self)
        if self.moe_aux_loss_coef is not None and self.moe_aux_loss_coef < 0:
            raise ValueError(
                f"--moe-aux-loss-coef ({self.moe_aux_loss_coef}) must be >= 0 (0 turns it off)"
            )

    def check_checkpoint(self, hf_checkpoint: str) -> None:
        from miles.utils.hf_config import hf_config_value

        model_type = hf_config_value(hf_checkpoint, "model_type")  # None: a hub id, read later
        vision = hf_config_value(hf_checkpoint, "vision_config") is not None
        if self.freeze_vision_tower and model_type is not None and not vision:
            raise ValueError(
                f"--freeze-vision-tower: {hf_checkpoint} ({model_type}) has no vision tower; "
                "drop the flag"
            )
        if self.uses_lora and vision:
            raise ValueError(
                f"--lora-rank {self.lora_rank}: LoRA on a vision-language model ({model_type}) "
                "is not supported yet; train it fully (optionally --freeze-vision-tower)"
            )
        if self.uses_lora:
            # Imported here: the check builds the model on the meta device (torch, PEFT).
            from miles.backends.fsdp_utils.lora import check_lora_checkpoint

            check_lora_checkpoint(self, hf_checkpoint)


def _check_unsupported(args: FSDPArgs) -> None:
    if args.context_parallel_size > 1:
        raise ValueError(
            f"--context-parallel-size {args.context_parallel_size}: context parallelism is not "
            "supported yet by the FSDP backend; use --context-parallel-size 1 (or the Megatron "
            "backend)"
        )
    if args.attn_implementation == "flash_attention_2":
        _check_flash_attention()


def _check_flash_attention() -> None:
    # Imported here: the device module imports torch, which reading the config must not.
    from miles.backends.training_utils.infra.device import get_device_info

    kind = get_device_info().kind
    # ROCm builds of PyTorch run flash-attn through the same "cuda" device type.
    if kind not in ("cuda", "rocm"):
        raise ValueError(
            f"--attn-implementation flash_attention_2 needs a CUDA GPU, but this process runs on "
            f"{kind}; use --attn-implementation sdpa"
        )
    if importlib.util.find_spec("flash_attn") is None:
        raise ValueError(
            "--attn-implementation flash_attention_2 needs the flash-attn package, which is not "
            "installed; install it or use --attn-implementation sdpa"
        )


def validate_hybrid_shard_args(world_size: int, dp_replicate_size: int) -> None:
    """Check that --dp-replicate-size splits the `world_size` training ranks into equal replicas."""
    if world_size < 1:
        raise ValueError(f"the training world size must be >= 1, got {world_size}")
    if dp_replicate_size < 1 or world_size % dp_replicate_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"--dp-replicate-size ({dp_replicate_size}) must be >= 1 and divide the number of "
            f"training ranks ({world_size}); each HSDP replica shards over world size / replicas "
            f"ranks: use one of {divisors}"
        )
