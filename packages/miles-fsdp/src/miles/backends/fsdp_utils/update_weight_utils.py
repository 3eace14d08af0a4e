"""Push an FSDP2 model's weights to the rollout engines (DESIGN §3.4), colocated or disaggregated.

Every rank walks the parameters in the same order and gathers each full tensor (a collective);
rank 0 alone talks to the engines: it pauses generation, hands the pairs to a miles-sglang sender
(which buckets them within `buffer_size` and flushes the KV cache with the last bucket) and
resumes generation. Tensors are gathered as the sender pulls them, so memory stays bounded.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils.precision import hf_parameter_name
from miles.backends.sglang_utils.weight_sync import DistributedWeightSender, TensorWeightSender
from miles.backends.training_utils.device import current_device

logger = logging.getLogger(__name__)


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
    # Shards offloaded to the host (--fsdp-cpu-offload) visit the device for an nccl gather.
    gather_device = current_device() if _backend() not in (None, "gloo") else None
    for name, tensor in named:
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if isinstance(tensor, DTensor):
            if gather_device is not None and tensor.device != gather_device:
                tensor = tensor.to(gather_device)
            tensor = tensor.full_tensor()
        yield hf_parameter_name(name), tensor


class _WeightUpdater:
    """Shared flow of both transports; subclasses say how rank 0 sends."""

    def __init__(
        self, model: nn.Module, clients: Sequence[Any], *, buffer_size: int, dtype: torch.dtype
    ) -> None:
        if buffer_size < 1:
            raise ValueError(
                f"--update-weight-buffer-size ({buffer_size}) must be at least 1 byte; use e.g. "
                "536870912 (512 MiB)"
            )
        self.model = model
        self.clients = list(clients)
        self.buffer_size = buffer_size
        self.dtype = dtype
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if self.rank == 0 and not self.clients:
            raise ValueError(
                "no rollout engine to update: rank 0 got no engine clients; pass the engines' "
                "URLs (--engine-urls) or do not call update_weights"
            )

    def update(self, weight_version: str) -> None:
        """Send every weight to every engine as `weight_version`; all ranks must call this."""
        start = time.monotonic()
        tensors = iter_full_tensors(self.model, self.dtype)
        error: BaseException | None = None
        if self.rank == 0:
            error = self._send_paused(tensors, weight_version)
        # Ranks > 0 (and rank 0 after a failed send) still join every remaining gather, so no
        # rank is left waiting in a collective.
        for _ in tensors:
            pass
        self._agree_on_failure(error)
        logger.info(
            "rank %d: weight version %s pushed in %.2f s", self.rank, weight_version,
            time.monotonic() - start,
        )  # fmt: skip

    def _send_paused(self, tensors: Iterator, weight_version: str) -> BaseException | None:
        """Pause every engine, send, resume every engine; return the failure instead of raising."""
        paused, error = [], None
        try:
            for client in self.clients:
                client.pause_generation(mode="in_place")
                paused.append(client)
            self._send(tensors, weight_version)
        except Exception as err:  # reported to every rank in _agree_on_failure
            logger.exception("weight update %s failed on rank 0", weight_version)
            error = err
        for client in paused:  # an engine left paused would stall the next rollout forever
            try:
                client.continue_generation()
            except Exception as err:
                logger.exception("continue_generation failed on %r", client)
                error = error or err
        return error

    def _agree_on_failure(self, error: BaseException | None) -> None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            if error is not None:
                raise error
            return
        failed = torch.tensor([int(error is not None)], device=_collective_device())
        dist.broadcast(failed, src=0)
        if error is not None:
            raise error
        if failed.item():
            raise RuntimeError(
                "the weight update failed on rank 0 (see its log for the engine's message); the "
                "engines may hold a partial update: push the weights again"
            )

    def _send(self, tensors: Iterator, weight_version: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the transport holds (nothing for the colocated one)."""


class UpdateWeightFromTensor(_WeightUpdater):
    """Colocated engines: hand buckets over by shared memory (CPU) or CUDA IPC handles."""

    def __init__(
        self, model: nn.Module, clients: Sequence[Any], *, buffer_size: int, dtype: torch.dtype
    ) -> None:
        super().__init__(model, clients, buffer_size=buffer_size, dtype=dtype)
        self._sender = (
            TensorWeightSender(self.clients, max_bytes=buffer_size, dtype=dtype)
            if self.rank == 0
            else None
        )

    def _send(self, tensors: Iterator, weight_version: str) -> None:
        assert self._sender is not None, "only rank 0 sends"
        self._sender.send(tensors, weight_version=weight_version)


class UpdateWeightFromDistributed(_WeightUpdater):
    """Disaggregated engines: broadcast buckets from rank 0 over a group with the engines.

    The group forms at the first update (every engine joins over HTTP) and lives until `close()`.
    `master_port` 0 picks a free port on rank 0's host.
    """

    def __init__(
        self,
        model: nn.Module,
        clients: Sequence[Any],
        *,
        buffer_size: int,
        dtype: torch.dtype,
        master_address: str,
        master_port: int,
        backend: str,
        group_name: str = "miles-fsdp-weights",
    ) -> None:
        super().__init__(model, clients, buffer_size=buffer_size, dtype=dtype)
        self._group = {"master_address": master_address, "master_port": master_port,
                       "group_name": group_name, "backend": backend}  # fmt: skip
        self._sender: DistributedWeightSender | None = None  # connected, on rank 0

    def _send(self, tensors: Iterator, weight_version: str) -> None:
        if self._sender is None:
            group = dict(self._group)
            # Picked right before the group forms, so the port is still free when it binds.
            group["master_port"] = group["master_port"] or _free_port(group["master_address"])
            sender = DistributedWeightSender(
                self.clients, **group, max_bytes=self.buffer_size, dtype=self.dtype
            )
            sender.connect()
            self._sender = sender
        try:
            self._sender.send(tensors, weight_version=weight_version)
        except Exception:
            # The group is out of step with the engines after a failed broadcast: form a new
            # one at the next update.
            self.close()
            raise

    def close(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def _backend() -> str | None:
    return dist.get_backend() if dist.is_initialized() else None


def _collective_device() -> torch.device:
    # gloo reduces CPU tensors; nccl / hccl need the rank's current accelerator.
    return torch.device("cpu") if dist.get_backend() == "gloo" else current_device()
