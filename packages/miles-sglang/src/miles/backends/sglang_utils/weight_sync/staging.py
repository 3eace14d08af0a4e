"""The trainer's bucket memory: two flat buffers allocated once and reused by every sync.

A sync used to allocate every bucket afresh: a cast copy of each tensor, then, for the colocated
transport, a new /dev/shm segment per tensor (the kernel zero-fills each fresh page on first
touch: 6x the cost of the copy itself, measured on the 89.9M model of `bench/weight_sync.py`).
Here each tensor is cast and copied once, as it arrives, into a buffer that already exists, and
the two buffers alternate: the next bucket is packed into one while the engines still read the
other. Together they hold `--update-weight-buffer-size` bytes (half each), so the trainer's
bucket memory is what it was: one bucket's worth (architecture.md: "Contracts / Weight sync").

A packed bucket is a `FlattenedBucket` whose flat tensors are views into a buffer: the tensors of
the bucket's first dtype back to back from the start, the few of any other dtype (an integer
buffer) in a region of their own after them, in order of first appearance.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from miles.backends.sglang_utils.weight_sync.buckets import (
    FlattenedBucket,
    TensorMeta,
    _validate,
    dtype_name,
)

# Regions of a second dtype start at a multiple of this many bytes: any element size divides it.
_ALIGN = 64
# A buffer's first size, doubled as a sync needs more, up to the bucket size.
_FIRST_BYTES = 1 << 20


class StagingBuffers:
    """Two reusable byte buffers of at most `max_bytes // 2` each, on the device of the tensors
    staged; in shared memory (`shared`) when they travel by handle to another process."""

    def __init__(self, max_bytes: int, *, shared: bool) -> None:
        _validate(max_bytes, None)
        self.bucket_bytes = max(1, max_bytes // 2)
        self.shared = shared
        self._buffers: list[Tensor | None] = [None, None]

    def reserve(self, index: int, nbytes: int, device: torch.device) -> Tensor:
        """Buffer `index` (0 or 1) with room for `nbytes`, its contents kept. A buffer grows by
        doubling up to the bucket size (a small model's buffers stay small), so only the first
        sync allocates; a tensor larger than a bucket grows it to its own size (it travels
        alone, as `iter_buckets` sends it)."""
        current = self._buffers[index]
        if current is not None and current.numel() >= nbytes and current.device == device:
            return current
        old = 0 if current is None or current.device != device else current.numel()
        size = min(max(nbytes, 2 * old, _FIRST_BYTES), max(nbytes, self.bucket_bytes))
        grown = self._allocate(size, device)
        if old:
            grown[:old].copy_(current)  # the bucket packed so far
        self._buffers[index] = grown
        return grown

    def _allocate(self, nbytes: int, device: torch.device) -> Tensor:
        if self.shared and device.type == "cpu":
            # Named /dev/shm segments (torch's `file_system` sharing), as `share_tensor` makes.
            storage = torch.UntypedStorage._new_using_filename_cpu(nbytes)
            buffer = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))
        else:  # CUDA memory travels by IPC handle as it is; a broadcast reads any memory
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        buffer.zero_()  # fault every page in now, not inside the first sync's copies
        return buffer

    def release(self) -> None:
        """Free both buffers (a shared segment goes once every engine has dropped it too)."""
        self._buffers = [None, None]

    def trim(self) -> None:
        """After a sync: free what should not be held until the next one. Accelerator memory
        goes (colocated engines generate in it meanwhile, and the caching allocator gives it
        back cheaply); so does a buffer grown past the bucket size for one large tensor, so that
        between syncs the buffers hold at most the bound. What stays: CPU buffers within it,
        whose reuse saves faulting in fresh pages."""
        self._buffers = [
            buffer
            if buffer is not None
            and buffer.device.type == "cpu"
            and buffer.numel() <= self.bucket_bytes
            else None
            for buffer in self._buffers
        ]

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers if b is not None)


def pack_buckets(
    named_tensors: Iterable[tuple[str, Tensor]],
    staging: StagingBuffers,
    *,
    dtype: torch.dtype | None,
) -> Iterator[tuple[FlattenedBucket, bool]]:
    """Cast and copy `(name, tensor)` pairs into the staging buffers, bucket by bucket; each
    bucket with whether it is the last. Buckets alternate between the two buffers, so the caller
    must be done with a bucket before it asks for the one after the next. With `dtype`,
    floating-point tensors are cast to it (integer and bool buffers keep theirs)."""
    _validate(staging.bucket_bytes, dtype)
    index, bucket = 0, _Bucket()
    for name, tensor in named_tensors:
        tensor = tensor.detach()
        kind = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        nbytes = bucket.cost(tensor, kind)
        if bucket.entries and bucket.nbytes + nbytes > staging.bucket_bytes:
            yield bucket.close(), False
            index, bucket = 1 - index, _Bucket()
            nbytes = bucket.cost(tensor, kind)
        device = tensor.device if bucket.buffer is None else bucket.buffer.device
        bucket.buffer = staging.reserve(index, bucket.nbytes + nbytes, device)
        bucket.add(name, tensor, kind, nbytes)
    if bucket.entries:
        yield bucket.close(), True


class _Bucket:
    """One bucket being packed: its first dtype's tensors are copied in as they arrive; tensors
    of another dtype wait (by reference) for their region, placed after them at `close`."""

    def __init__(self) -> None:
        self.buffer: Tensor | None = None
        self.entries = 0
        self.nbytes = 0  # of the buffer, the alignment of each further dtype's region included
        self._first: torch.dtype | None = None
        self._end = 0  # bytes of the first dtype packed so far
        self._metadata: list[TensorMeta | None] = []  # in order of arrival
        self._waiting: list[tuple[int, str, Tensor, torch.dtype]] = []

    def cost(self, tensor: Tensor, kind: torch.dtype) -> int:
        """The buffer bytes `tensor` takes in this bucket: a new dtype's region may need padding."""
        nbytes = tensor.numel() * kind.itemsize
        known = {self._first} | {other for _, _, _, other in self._waiting}
        return nbytes if self._first is None or kind in known else nbytes + _ALIGN

    def add(self, name: str, tensor: Tensor, kind: torch.dtype, nbytes: int) -> None:
        self.entries += 1
        self.nbytes += nbytes
        if self._first is None:
            self._first = kind
        if kind != self._first:
            self._waiting.append((len(self._metadata), name, tensor, kind))
            self._metadata.append(None)
            return
        self._metadata.append(self._copy_in(name, tensor, kind, self._end, 0))
        self._end += tensor.numel() * kind.itemsize

    def _copy_in(
        self, name: str, tensor: Tensor, kind: torch.dtype, at: int, region: int
    ) -> TensorMeta:
        """Copy `tensor`, cast to `kind`, to byte `at` of the buffer; its metadata, its offset
        counted in elements from the start of its region (byte `region`)."""
        assert self.buffer is not None
        nbytes = tensor.numel() * kind.itemsize
        view = self.buffer[at : at + nbytes].view(kind).view(tensor.shape)
        view.copy_(tensor)  # casts as it copies: the one copy this side makes of each byte
        offset = (at - region) // kind.itemsize
        return TensorMeta(name, dtype_name(kind), tuple(tensor.shape), offset, tensor.numel())

    def close(self) -> FlattenedBucket:
        assert self.buffer is not None and self._first is not None
        flat = {dtype_name(self._first): self.buffer[: self._end].view(self._first)}
        at = self._end
        for kind in dict.fromkeys(kind for _, _, _, kind in self._waiting):  # first appearance
            region = at = -(-at // _ALIGN) * _ALIGN
            for position, name, tensor, other in self._waiting:
                if other == kind:
                    self._metadata[position] = self._copy_in(name, tensor, kind, at, region)
                    at += tensor.numel() * kind.itemsize
            flat[dtype_name(kind)] = self.buffer[region:at].view(kind)
        metadata = [meta for meta in self._metadata if meta is not None]
        assert len(metadata) == self.entries
        return FlattenedBucket(flat=flat, metadata=metadata)
