"""Which dtype each copy of the weights lives in: master weights, compute, gradient reduction, and
the copy sent to the rollout engines.

Master weights and optimizer states stay float32 (FSDP2 keeps the sharded parameters in the dtype
the model was built in); FSDP2 casts to `param_dtype` for forward/backward only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from miles.backends.fsdp_utils.arguments import FSDPArgs
from miles.backends.fsdp_utils.param_names import hf_parameter_name
from miles.backends.training_utils.infra.device import DEVICE_KINDS

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """Dtypes of the FSDP backend. `param_dtype` is what forward/backward compute in."""

    param_dtype: torch.dtype
    """Compute dtype; FSDP2 all-gathers parameters in it."""
    reduce_dtype: torch.dtype
    """Dtype of gradient reduce-scatter / all-reduce."""
    master_dtype: torch.dtype = torch.float32
    """Dtype of the sharded parameters the optimizer updates (and of its states)."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "master_dtype"):
            dtype = getattr(self, name)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise ValueError(
                    f"PrecisionPolicy.{name} must be a floating torch.dtype, got {dtype!r}"
                )

    @classmethod
    def from_args(cls, args: FSDPArgs, device_kind: str) -> PrecisionPolicy:
        """--param-dtype auto: bfloat16 on accelerators, float32 on CPU (where bfloat16 matmuls are
        slow on most hosts and float32 keeps the CPU tests exact)."""
        if device_kind not in DEVICE_KINDS:
            raise ValueError(
                f"device kind {device_kind!r} is not one of {', '.join(DEVICE_KINDS)}; pass "
                "get_device_info().kind"
            )
        if args.param_dtype == "auto":
            param_dtype = torch.float32 if device_kind == "cpu" else torch.bfloat16
        else:
            param_dtype = _DTYPES[args.param_dtype]
        policy = cls(param_dtype=param_dtype, reduce_dtype=_DTYPES[args.reduce_dtype])
        logger.info("precision on %s: %s", device_kind, policy)
        return policy

    def mixed_precision(self) -> MixedPrecisionPolicy:
        """The FSDP2 policy: cast to `param_dtype` for compute, reduce in `reduce_dtype`."""
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    @property
    def engine_dtype(self) -> torch.dtype:
        """Weights go to the engines in the compute dtype, so the engine samples from the same
        rounded weights the trainer's forward pass uses (closest step-0 log-prob agreement)."""
        return self.param_dtype

    def record(self, model: torch.nn.Module) -> dict[str, torch.dtype]:
        """Engine dtype per parameter (Hugging Face names; tied parameters appear once).

        Floating parameters get `engine_dtype`; any other parameter keeps its own dtype.
        """
        return {
            hf_parameter_name(name): self.engine_dtype if p.dtype.is_floating_point else p.dtype
            for name, p in model.named_parameters()
        }
