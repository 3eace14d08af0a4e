"""Disaggregated weight hand-over: a broadcast group between trainer rank 0 and the engines.

Built from its own TCPStore and a directly constructed backend, never `dist.init_process_group`
(either side may own a default group). Store keys are nested as SGLang's own
`init_custom_process_group` nests them, so a real SGLang engine can join the same group.
"""

from __future__ import annotations

import datetime
import logging
import socket
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from miles.backends.sglang_utils.weight_sync.buckets import (
    FlattenedBucket,
    NamedTensors,
    TensorMeta,
    dtype_from_name,
    dtype_name,
    unflatten_bucket,
)

logger = logging.getLogger(__name__)

# The device segment of the store prefix torch gives each backend (its first capable device).
_STORE_DEVICE = {"gloo": "cpu", "nccl": "cuda"}


class WeightUpdateGroup:
    """A process group of trainer rank 0 (rank 0) and the engines (ranks 1..world_size-1)."""

    def __init__(
        self, *, store: dist.Store, backend: object, rank: int, world_size: int, name: str
    ):
        self._store = store  # the backend reads keys from it for its whole life; keep it alive
        self._backend = backend
        self.rank = rank
        self.world_size = world_size
        self.name = name

    def broadcast(self, tensor: Tensor, src: int = 0) -> None:
        """Broadcast `tensor` from rank `src` to every rank, in place; blocks until done."""
        self.broadcast_async(tensor, src).wait()

    def broadcast_async(self, tensor: Tensor, src: int = 0) -> dist.Work:
        """Start a broadcast and return its work handle (call `.wait()` before using `tensor`)."""
        if self._backend is None:
            raise RuntimeError(f"weight update group {self.name!r} was destroyed; create a new one")
        if not tensor.is_contiguous():
            raise ValueError(f"broadcast needs a contiguous tensor, got strides {tensor.stride()}")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return self._backend.broadcast([tensor], opts)

    def destroy(self) -> None:
        """Shut the backend down and release the store (idempotent)."""
        backend, self._backend = self._backend, None
        if backend is not None and hasattr(backend, "shutdown"):
            backend.shutdown()
        self._store = None


def create_weight_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = 300,
) -> WeightUpdateGroup:
    """Join the group as `rank`; blocks until all `world_size` ranks have joined (or timeout).

    Rank 0 (the trainer) hosts the TCPStore at `master_address:master_port`; the others connect.
    `backend` is "gloo" (CPU tensors) or "nccl" (CUDA tensors).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank ({rank}) must be in [0, world_size={world_size})")
    if backend not in _STORE_DEVICE:
        raise ValueError(
            f"weight update backend {backend!r} is not supported; use 'gloo' or 'nccl'"
        )
    if not group_name:
        raise ValueError("group_name must be a non-empty string")
    timeout = datetime.timedelta(seconds=timeout_s)
    logger.info(
        "joining weight update group %r as rank %d of %d (%s, store %s:%d, timeout %.0f s)",
        group_name, rank, world_size, backend, master_address, master_port, timeout_s,
    )  # fmt: skip
    store = _rendezvous_store(master_address, master_port, world_size, rank, timeout)
    prefixed = _backend_store(store, group_name, backend)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        pg = _nccl_backend(prefixed, rank, world_size, timeout, group_name)
    return WeightUpdateGroup(
        store=store, backend=pg, rank=rank, world_size=world_size, name=group_name
    )


def _rendezvous_store(
    address: str, port: int, world_size: int, rank: int, timeout: datetime.timedelta
) -> dist.TCPStore:
    """The group's TCPStore: rank 0 serves it on `address` only, the others connect to it.

    TCPStore's own master listens on every interface; a loopback run's rendezvous would be open to
    the network. So rank 0 binds the listening socket itself and hands it over.
    """
    if rank != 0:
        return dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    listener = _listen_on(address, port)
    # The store's server takes the socket over and closes it, also when the rendezvous fails.
    return dist.TCPStore(
        address, port, world_size, is_master=True, timeout=timeout,
        master_listen_fd=listener.detach(), use_libuv=True,
    )  # fmt: skip


def _listen_on(address: str, port: int) -> socket.socket:
    family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(sockaddr)
        listener.listen(socket.SOMAXCONN)
    except OSError as err:
        listener.close()
        raise RuntimeError(
            f"the weight update group cannot listen on {address}:{port} ({err}); pass an address "
            "of this host and a free port"
        ) from err
    return listener


def _backend_store(store: dist.Store, group_name: str, backend: str) -> dist.Store:
    """The store view a backend of this group reads and writes, nested as SGLang's side nests it.

    SGLang's `init_custom_process_group` prefixes the rendezvous store with the group name, then
    torch's `_new_process_group_helper` adds "<group>/" and "<device>/" (the backend's first
    capable device); an engine using it looks up exactly these keys.
    """
    by_group = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    return dist.PrefixStore(f"{_STORE_DEVICE[backend]}/", by_group)


def _nccl_backend(store, rank: int, world_size: int, timeout, group_name: str):
    if not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise RuntimeError(
            "weight update backend 'nccl' needs CUDA and a torch built with NCCL; "
            "use backend 'gloo' on CPU"
        )
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.is_high_priority_stream = False
    options.group_name = group_name
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def broadcast_tensors(
    group: WeightUpdateGroup, named_tensors: Iterable[tuple[str, Tensor]]
) -> None:
    """Sending side (rank 0): one broadcast per tensor, in order, as the engines receive them."""
    works = [group.broadcast_async(tensor.contiguous(), src=0) for _, tensor in named_tensors]
    for work in works:
        work.wait()


FLATTENED_BUCKET = "flattened_bucket"
"""The `load_format` of /update_weights_from_distributed under which an update travels as one
broadcast: its tensors (one dtype) flattened end to end in the order of `names`, the layout of
SGLang's `FlattenedTensorBucket` (sgl-project/sglang#13824), against one broadcast per tensor."""


DISTRIBUTED_LOAD_FORMATS = "update_weights_from_distributed_load_formats"
"""The /get_server_info key under which an engine lists the `load_format`s its
/update_weights_from_distributed reads besides one broadcast per tensor (the reference engine:
`FLATTENED_BUCKET`). SGLang does not list them, whatever its release reads."""


class ReceiveBuffer:
    """An engine's memory for flattened buckets: grown to the largest bucket received, then
    reused by every update (a fresh allocation per bucket costs the kernel zero-filling each
    page on first touch). The received views are only valid until the next receive."""

    def __init__(self) -> None:
        self._buffer: Tensor | None = None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
        nbytes = numel * dtype.itemsize
        buffer = self._buffer
        if buffer is None or buffer.numel() < nbytes or buffer.device != torch.device(device):
            self._buffer = None  # the old one goes before the new one is allocated
            buffer = self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buffer[:nbytes].view(dtype)

    def release(self) -> None:
        self._buffer = None


def receive_flattened(
    group: WeightUpdateGroup,
    names: Sequence[str],
    dtypes: Sequence[str | torch.dtype],
    shapes: Sequence[Sequence[int]],
    device: torch.device | str,
    *,
    buffer: ReceiveBuffer | None = None,
) -> NamedTensors:
    """Receiving side of a `FLATTENED_BUCKET` update (one dtype, as senders send it): one
    broadcast into one buffer (`buffer`'s, reused, else a new one), then a view per tensor, in
    the order of `names`."""
    _check_lengths(names, dtypes, shapes)
    kind = flattened_dtype(dtypes)
    metadata, offset = [], 0
    for name, shape in zip(names, shapes, strict=True):
        numel = int(torch.Size(shape).numel())
        metadata.append(TensorMeta(name, kind, tuple(shape), offset, numel))
        offset += numel
    if buffer is not None:
        flat = buffer.take(offset, dtype_from_name(kind), device)
    else:
        flat = torch.empty(offset, dtype=dtype_from_name(kind), device=device)
    group.broadcast(flat, src=0)
    return unflatten_bucket(FlattenedBucket(flat={kind: flat}, metadata=metadata))


def flattened_dtype(dtypes: Sequence[str | torch.dtype]) -> str:
    """The one dtype (its name) of a `FLATTENED_BUCKET` update; ValueError for none or several."""
    kinds = {dtype_name(dtype_from_name(dtype)) for dtype in dtypes}
    if len(kinds) != 1:
        raise ValueError(
            f"a flattened bucket holds tensors of one dtype, got {sorted(kinds)}; send one "
            "update per dtype"
        )
    return kinds.pop()


def _check_lengths(names: Sequence, dtypes: Sequence, shapes: Sequence) -> None:
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) "
            "must have equal lengths"
        )


def receive_tensors(
    group: WeightUpdateGroup,
    names: Sequence[str],
    dtypes: Sequence[str | torch.dtype],
    shapes: Sequence[Sequence[int]],
    device: torch.device | str,
) -> NamedTensors:
    """Receiving side (an engine): allocate each tensor and receive it, in the order of `names`."""
    _check_lengths(names, dtypes, shapes)
    tensors = [
        torch.empty(tuple(shape), dtype=dtype_from_name(dtype), device=device)
        for dtype, shape in zip(dtypes, shapes, strict=True)
    ]
    # Issue all receives before waiting on any, as SGLang does: many small tensors overlap.
    works = [group.broadcast_async(tensor, src=0) for tensor in tensors]
    for work in works:
        work.wait()
    return list(zip(names, tensors, strict=True))
