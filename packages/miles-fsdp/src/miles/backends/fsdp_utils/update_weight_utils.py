"""An FSDP2 model's weights under the engines' names, for weight sync.

(architecture.md: "Contracts / Weight sync")

Every rank walks the parameters in the same order and gathers each full tensor (a collective) as
the miles-sglang updater pulls them, so memory stays bounded; the pause / send / resume flow and
both transports are miles-sglang's (`weight_sync.make_weight_updater`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils.param_names import hf_parameter_name
from miles.backends.training_utils.infra.device import current_device


def iter_full_tensors(
    model: nn.Module, dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for each parameter, then each persistent buffer, in module order.

    Every rank must drain this iterator to the end: `full_tensor()` is a collective. Floating
    tensors are cast on the local shard, before the gather, so the gather moves engine-dtype
    bytes. Tied parameters come once (under the first name), as an engine loads either name.
    """
    persistent = set(model.state_dict().keys())
    named = list(model.named_parameters())
    named += [(n, b) for n, b in model.named_buffers() if n in persistent]
    for name, tensor in named:
        yield hf_parameter_name(name), full_tensor(tensor, dtype)


def full_tensor(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole of a (sharded) parameter, detached; a collective for a DTensor. A floating
    tensor is cast to `dtype` on the local shard, before the gather moves its bytes."""
    tensor = tensor.detach()
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    if not isinstance(tensor, DTensor):
        return tensor
    # Shards offloaded to the host (--fsdp-cpu-offload) visit the device for an nccl gather.
    if _backend() not in (None, "gloo") and tensor.device != current_device():
        tensor = tensor.to(current_device())
    return tensor.full_tensor()


def _backend() -> str | None:
    return dist.get_backend() if dist.is_initialized() else None
