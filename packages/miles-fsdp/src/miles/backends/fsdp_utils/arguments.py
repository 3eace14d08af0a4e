"""Settings of the FSDP training backend: one dataclass, loaded from YAML and command-line flags.

Every field is a user flag (`lr_decay_style` is `--lr-decay-style`). Settings this backend cannot
honour raise at load time, naming the flag, instead of being silently ignored (architecture.md: "Design rules").
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import logging
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from miles.config.options import convert
from miles.config.options import flag_name as _flag
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
    lora_rank: int = 0
    """LoRA adapter rank; the FSDP backend supports only 0 (full fine-tuning) for now."""
    use_critic: bool = False
    """Train a value model; the FSDP backend has no critic yet."""

    MINIMUMS: typing.ClassVar[dict[str, float]] = {
        **TrainerArgs.MINIMUMS,
        "lora_rank": 0,
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


def _check_unsupported(args: FSDPArgs) -> None:
    if args.context_parallel_size > 1:
        raise ValueError(
            f"--context-parallel-size {args.context_parallel_size}: context parallelism is not "
            "supported yet by the FSDP backend; use --context-parallel-size 1 (or the Megatron "
            "backend)"
        )
    if args.lora_rank > 0:
        raise ValueError(
            f"--lora-rank {args.lora_rank}: LoRA is not supported by the FSDP backend; use "
            "--lora-rank 0 (full fine-tuning)"
        )
    if args.use_critic:
        raise ValueError(
            "--use-critic: the FSDP backend has no critic yet; use a critic-free advantage "
            "estimator (grpo, dr_grpo, gspo, rloo, reinforce_plus_plus) or the Megatron backend"
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


def load_fsdp_args(config_path: str | None = None, argv: list[str] | None = None) -> FSDPArgs:
    """FSDPArgs from defaults, then a YAML file, then command-line flags (the last one wins).

    YAML keys may use `_` or `-` (`lr_decay_style` / `lr-decay-style`). Flags are `--lr 1e-5`,
    `--lr=1e-5`, and for booleans `--gradient-checkpointing` / `--no-gradient-checkpointing`.
    Unknown names are rejected with the closest valid one suggested.
    """
    values: dict[str, Any] = {}
    if config_path is not None:
        values.update(_read_yaml(config_path))
    if argv:
        values.update(_parse_argv(argv))
    return FSDPArgs(**values)


@functools.cache
def _field_types() -> dict[str, Any]:
    # The module uses postponed annotations, so the dataclass fields hold strings; resolve once.
    return typing.get_type_hints(FSDPArgs)


def _literal_choices(annotation: Any) -> tuple[str, ...]:
    return get_args(annotation) if get_origin(annotation) is Literal else ()


def _unknown(name: str, known: list[str], what: str) -> ValueError:
    """An "unknown FSDP <what>" error naming the closest known name (all of them if none is)."""
    match = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {match[0]!r}?" if match else f"; valid names: {', '.join(known)}"
    return ValueError(f"unknown FSDP {what}{hint}")


def _read_yaml(config_path: str) -> dict[str, Any]:
    with Path(config_path).open() as f:
        raw = yaml.safe_load(f)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(
            f"{config_path} must hold a mapping of FSDP settings (lr: 1e-6, ...), "
            f"got a {type(raw).__name__}"
        )
    types_ = _field_types()
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in types_:
            known = [n.replace("_", "-") if "-" in str(key) else n for n in types_]
            raise _unknown(str(key), known, f"setting {str(key)!r} in {config_path}")
        if name in values:
            raise ValueError(f"{config_path} sets {name!r} twice (with '_' and with '-')")
        values[name] = _convert(value, types_[name], f"{key!r} in {config_path}")
    return values


def _parse_argv(argv: list[str]) -> dict[str, Any]:
    types_ = _field_types()
    flags = [_flag(n) for n in types_]
    flags += [f"--no-{n.replace('_', '-')}" for n, t in types_.items() if t is bool]
    values: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--"):
            raise ValueError(f"unexpected argument {token!r}; FSDP flags look like --lr 1e-5")
        flag, has_value, value = token.partition("=")
        name = flag[2:].replace("-", "_")
        if name.startswith("no_") and types_.get(name[3:]) is bool and not has_value:
            values[name[3:]] = False
            continue
        if name not in types_:
            raise _unknown(flag, flags, f"flag {flag!r}")
        if types_[name] is bool and not has_value:
            values[name] = True
            continue
        if not has_value:
            if i >= len(argv) or argv[i].startswith("--"):
                raise ValueError(f"{flag} needs a value, e.g. {flag} <value>")
            value = argv[i]
            i += 1
        values[name] = _convert(value, types_[name], flag)
    return values


def _convert(value: Any, annotation: Any, where: str) -> Any:
    """`value` (from YAML or a command-line string) as the field's type, or a ValueError."""
    if _literal_choices(annotation):
        return str(value)  # membership is checked, with the choices listed, in __post_init__
    return convert(value, annotation, f"FSDP setting {where}")
