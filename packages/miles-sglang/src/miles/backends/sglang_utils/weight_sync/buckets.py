"""Group named tensors into size-bounded buckets, and flatten a bucket into one tensor per dtype.

Both transports send weights bucket by bucket so that the trainer never holds more than about
`--update-weight-buffer-size` bytes of cast, gathered weights at once (architecture.md:
"Contracts / Weight sync").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

NamedTensors = list[tuple[str, Tensor]]


def dtype_name(dtype: torch.dtype) -> str:
    """The torch name without its prefix, as SGLang writes dtypes on the wire: "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """Inverse of `dtype_name`; a torch.dtype passes through unchanged."""
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name; use e.g. 'bfloat16' or 'float32'")
    return dtype


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives inside the flat tensor of its dtype."""

    name: str
    dtype: str
    """torch dtype name without the prefix, e.g. "bfloat16"; also the key of the flat tensor."""
    shape: tuple[int, ...]
    offset: int
    """First element of this tensor in the flat tensor (in elements of `dtype`, not bytes)."""
    numel: int


def iter_buckets(
    named_tensors: Iterable[tuple[str, Tensor]],
    *,
    max_bytes: int,
    dtype: torch.dtype | None = None,
) -> Iterator[NamedTensors]:
    """Lazily group `(name, tensor)` pairs into buckets of at most `max_bytes` bytes each.

    With `dtype`, floating-point tensors are cast to it as they are pulled (and sized after the
    cast); integer and bool buffers keep their dtype. A tensor larger than `max_bytes` is not
    split: it travels alone in a bucket of its own, as SGLang's own bucketing does, so the limit
    is exceeded only by that one tensor. Memory stays bounded: the generator holds one bucket plus
    the tensor that did not fit, so callers should drop a bucket before asking for the next.
    Arguments are checked at the call, not at the first `next()`.
    """
    _validate(max_bytes, dtype)
    return _without_flags(_buckets(named_tensors, max_bytes, dtype))


def iter_buckets_with_last(
    named_tensors: Iterable[tuple[str, Tensor]],
    *,
    max_bytes: int,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[NamedTensors, bool]]:
    """`iter_buckets`, each bucket paired with whether it is the last one.

    Senders flush the engine's KV cache with the last bucket only; knowing "last" costs nothing
    here, because a bucket is only closed once the next tensor has been pulled or the input ended.
    """
    _validate(max_bytes, dtype)
    return _buckets(named_tensors, max_bytes, dtype)


def _buckets(
    named_tensors: Iterable[tuple[str, Tensor]], max_bytes: int, dtype: torch.dtype | None
) -> Iterator[tuple[NamedTensors, bool]]:
    bucket: NamedTensors = []
    size = 0
    for name, tensor in named_tensors:
        tensor = _cast(tensor, dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket, False
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket, True


def _without_flags(buckets: Iterator[tuple[NamedTensors, bool]]) -> Iterator[NamedTensors]:
    for bucket, _ in buckets:
        yield bucket
        # Drop our reference before the next bucket is built, so only one is ever alive.
        del bucket


def _validate(max_bytes: int, dtype: torch.dtype | None) -> None:
    if max_bytes < 1:
        raise ValueError(
            f"--update-weight-buffer-size ({max_bytes}) must be at least 1 byte; "
            "use e.g. 536870912 (512 MiB)"
        )
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"weights can only be cast to a floating-point dtype, got {dtype}")


def _cast(tensor: Tensor, dtype: torch.dtype | None) -> Tensor:
    tensor = tensor.detach()
    if dtype is None or not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype)


@dataclass
class FlattenedBucket:
    """A bucket as one 1-D contiguous tensor per dtype plus where each named tensor sits in it."""

    flat: dict[str, Tensor]
    """dtype name -> 1-D contiguous tensor holding every tensor of that dtype, back to back."""
    metadata: list[TensorMeta]
    """One entry per tensor, in the bucket's original order."""


def flatten_bucket(named_tensors: Iterable[tuple[str, Tensor]]) -> FlattenedBucket:
    """Pack tensors into one flat tensor per dtype (one copy); the bucket's order is kept."""
    parts: dict[str, list[Tensor]] = {}
    sizes: dict[str, int] = {}
    metadata: list[TensorMeta] = []
    for name, tensor in named_tensors:
        key = dtype_name(tensor.dtype)
        offset = sizes.get(key, 0)
        metadata.append(TensorMeta(name, key, tuple(tensor.shape), offset, tensor.numel()))
        parts.setdefault(key, []).append(tensor.detach().reshape(-1))
        sizes[key] = offset + tensor.numel()
    flat = {key: torch.cat(tensors) for key, tensors in parts.items()}  # each (sizes[key],)
    return FlattenedBucket(flat=flat, metadata=metadata)


def unflatten_bucket(bucket: FlattenedBucket) -> NamedTensors:
    """The named tensors of a flattened bucket, as views into its flat tensors, in order.

    Raises ValueError if the metadata does not fit the flat tensors (a corrupt or foreign payload).
    """
    out: NamedTensors = []
    for meta in bucket.metadata:
        flat = bucket.flat.get(meta.dtype)
        if flat is None:
            raise ValueError(
                f"tensor {meta.name!r} has dtype {meta.dtype!r} but the bucket only holds "
                f"{sorted(bucket.flat)}"
            )
        if dtype_name(flat.dtype) != meta.dtype or flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(
                f"flat tensor for {meta.dtype!r} must be 1-D and contiguous of that dtype, got "
                f"{dtype_name(flat.dtype)} with shape {tuple(flat.shape)}"
            )
        shape_numel = 1
        for dim in meta.shape:
            shape_numel *= dim
        end = meta.offset + meta.numel
        if shape_numel != meta.numel or meta.offset < 0 or end > flat.numel():
            raise ValueError(
                f"tensor {meta.name!r}: shape {meta.shape} (numel {shape_numel}) at elements "
                f"[{meta.offset}, {end}) does not fit numel {meta.numel} in a flat "
                f"{meta.dtype} tensor of {flat.numel()} elements"
            )
        out.append((meta.name, flat[meta.offset : end].view(meta.shape)))
    return out
