"""A trainer's weight update: pause the engines, send, resume, agree on failure.

(architecture.md: "Contracts / Weight sync")

Shared by every backend: a backend only says how to produce its `(engine name, full tensor)` pairs
(gathering shards is its business; every rank drains the iterator, and the ranks given engine
clients talk to those engines: rank 0 to all of them, or, colocated one engine per rank, each rank
to the engine on its own device, see `engine_urls_for_rank`). A sending rank pauses generation in
place, hands the pairs to a sender (which buckets them within `buffer_size` and flushes the KV
cache with the last bucket) and resumes generation even after a failure, then every rank learns
whether any send failed, so no rank is left in a collective.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from miles.backends.sglang_utils.engine_transport import EngineTimeouts
from miles.backends.sglang_utils.weight_sync.distributed_transport import (
    DISTRIBUTED_LOAD_FORMATS,
    FLATTENED_BUCKET,
)
from miles.backends.sglang_utils.weight_sync.senders import (
    DistributedWeightSender,
    TensorWeightSender,
)
from miles.backends.training_utils.infra.device import current_device, dist_backend

logger = logging.getLogger(__name__)


def engine_urls_for_rank(
    engine_urls: Sequence[str], *, rank: int, world_size: int, colocate: bool
) -> list[str]:
    """The engines train rank `rank` pushes weights to.

    Colocated with one engine per rank (engine r on rank r's device), rank r feeds engine r: a
    CUDA IPC handle opens only on the device it was made on, and the ranks send in parallel.
    Otherwise rank 0 feeds every engine (one broadcast group reaches them all).
    """
    if colocate and len(engine_urls) == world_size:
        return [engine_urls[rank]]
    return list(engine_urls) if rank == 0 else []


def make_weight_updater(
    named_tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]],
    *,
    engine_urls: Sequence[str],
    rank: int,
    world_size: int,
    colocate: bool,
    buffer_size: int,
    dtype: torch.dtype,
    master_address: str,
    group_name: str = "miles-weights",
    only: Collection[str] | None = None,
    timeout_s: float = 300.0,
    api_key: str | None = None,
    http_timeouts: EngineTimeouts | None = None,
) -> UpdateWeightFromTensor | UpdateWeightFromDistributed:
    """The updater of one train rank: clients for the engines it feeds (`engine_urls_for_rank`),
    then the colocated transport, or a broadcast group from rank 0 on a free port of
    `master_address` over the process group's backend, whose waits `timeout_s` bounds. `only`:
    feed just these of the engines (restarted ones), each from the rank that feeds it in the full
    set. `api_key`: the engines' admin key; `http_timeouts`: the bounds of the engine calls."""
    from miles.backends.sglang_utils.sync_client import SyncEngineClient

    urls = engine_urls_for_rank(engine_urls, rank=rank, world_size=world_size, colocate=colocate)
    if only is not None:
        urls = [url for url in urls if url in only]
    timeouts = {"timeouts": http_timeouts} if http_timeouts is not None else {}
    clients = [SyncEngineClient(url, api_key=api_key, **timeouts) for url in urls]
    if colocate:
        return UpdateWeightFromTensor(
            named_tensors, clients, buffer_size=buffer_size, dtype=dtype,
            require_clients=only is None,
        )  # fmt: skip
    return UpdateWeightFromDistributed(
        named_tensors, clients, buffer_size=buffer_size, dtype=dtype,
        master_address=master_address, master_port=0, backend=dist_backend(),
        group_name=group_name, require_clients=only is None, timeout_s=timeout_s,
    )  # fmt: skip


class WeightUpdater:
    """Shared flow of both transports; subclasses say how a rank with engine clients sends.

    `named_tensors()` yields the `(engine name, full tensor)` pairs of one update; every rank
    drains it (it may run collectives, e.g. gathering shards); ranks with clients send.
    """

    def __init__(
        self,
        named_tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]],
        clients: Sequence[Any],
        *,
        buffer_size: int | None,
        dtype: torch.dtype | None,
        require_clients: bool = True,
    ) -> None:
        """`require_clients`: rank 0 must feed an engine (not so for a restarted subset).
        `buffer_size` and `dtype` bound and cast the buckets of a bucketed transport (None for
        one that sends none, such as the LoRA adapter's files)."""
        if buffer_size is not None and buffer_size < 1:
            raise ValueError(
                f"--update-weight-buffer-size ({buffer_size}) must be at least 1 byte; use e.g. "
                "536870912 (512 MiB)"
            )
        self.named_tensors = named_tensors
        self.clients = list(clients)
        self.buffer_size = buffer_size
        self.dtype = dtype
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if require_clients and self.rank == 0 and not self.clients:
            raise ValueError(
                "no rollout engine to update: rank 0 got no engine clients; pass the engines' "
                "URLs (--engine-urls) or do not call update_weights"
            )

    def update(self, weight_version: str) -> None:
        """Send every weight to every engine as `weight_version`; all ranks must call this."""
        start = time.monotonic()
        tensors = self.named_tensors()
        error: BaseException | None = None
        if self.clients:
            error = self._send_paused(tensors, weight_version)
        # Ranks without engines (and a rank after a failed send) still join every remaining
        # gather, so no rank is left waiting in a collective.
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
            logger.exception("weight update %s failed on rank %d", weight_version, self.rank)
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
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if error is not None:
            raise error
        if failed.item():
            raise RuntimeError(
                "the weight update failed on another rank (see its log for the engine's "
                "message); the engines may hold a partial update: push the weights again"
            )

    def _send(self, tensors: Iterator, weight_version: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the transport holds (a group, staging buffers)."""

    def shutdown(self) -> None:
        """Close the transport and the engine clients: the updater is done for good."""
        self.close()
        for client in self.clients:
            client.close()


class UpdateWeightFromTensor(WeightUpdater):
    """Colocated engines: hand buckets over by shared memory (CPU) or CUDA IPC handles."""

    def __init__(
        self,
        named_tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]],
        clients: Sequence[Any],
        *,
        buffer_size: int,
        dtype: torch.dtype,
        require_clients: bool = True,
    ) -> None:
        super().__init__(
            named_tensors, clients, buffer_size=buffer_size, dtype=dtype,
            require_clients=require_clients,
        )  # fmt: skip
        self._sender = (
            TensorWeightSender(self.clients, max_bytes=buffer_size, dtype=dtype)
            if self.clients
            else None
        )

    def _send(self, tensors: Iterator, weight_version: str) -> None:
        assert self._sender is not None, "only ranks with engine clients send"
        self._sender.send(tensors, weight_version=weight_version)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()  # its staging buffers; a next send allocates them again


class UpdateWeightFromDistributed(WeightUpdater):
    """Disaggregated engines: broadcast buckets from rank 0 over a group with the engines.

    The group forms at the first update (every engine joins over HTTP) and lives until `close()`.
    `master_port` 0 picks a free port on rank 0's host.
    """

    def __init__(
        self,
        named_tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]],
        clients: Sequence[Any],
        *,
        buffer_size: int,
        dtype: torch.dtype,
        master_address: str,
        master_port: int,
        backend: str,
        group_name: str = "miles-weights",
        require_clients: bool = True,
        timeout_s: float = 300.0,
    ) -> None:
        super().__init__(
            named_tensors, clients, buffer_size=buffer_size, dtype=dtype,
            require_clients=require_clients,
        )  # fmt: skip
        self._group = {"master_address": master_address, "master_port": master_port,
                       "group_name": group_name, "backend": backend,
                       "timeout_s": timeout_s}  # fmt: skip
        self._sender: DistributedWeightSender | None = None  # connected, on rank 0

    def _send(self, tensors: Iterator, weight_version: str) -> None:
        if self._sender is None:
            group = dict(self._group)
            # Picked right before the group forms, so the port is still free when it binds.
            group["master_port"] = group["master_port"] or _free_port(group["master_address"])
            sender = DistributedWeightSender(
                self.clients, **group, max_bytes=self.buffer_size, dtype=self.dtype,
                load_format=distributed_load_format(self.clients),
            )  # fmt: skip
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


def distributed_load_format(clients: Sequence[Any]) -> str | None:
    """`FLATTENED_BUCKET` where every engine's server info lists it under
    `DISTRIBUTED_LOAD_FORMATS` (the reference engine's does), else None: one broadcast per
    tensor, which every SGLang release reads (theirs list nothing; only releases with
    sgl-project/sglang#13824 read flat buckets)."""
    for client in clients:
        if FLATTENED_BUCKET not in client.get_server_info().get(DISTRIBUTED_LOAD_FORMATS, ()):
            return None
    return FLATTENED_BUCKET


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def _collective_device() -> torch.device:
    # gloo reduces CPU tensors; nccl / hccl need the rank's current accelerator.
    return torch.device("cpu") if dist.get_backend() == "gloo" else current_device()
