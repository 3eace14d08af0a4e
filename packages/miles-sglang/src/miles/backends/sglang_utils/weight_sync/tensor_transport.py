"""Colocated weight hand-over (`/update_weights_from_tensor`): only handles travel, not data.

CPU tensors become named /dev/shm segments (torch's `file_system` sharing: any process on the host
opens them by name, unlike `file_descriptor` handles), CUDA tensors become CUDA IPC handles. The
receiver unpickles with an allow-list, since the payload arrives over HTTP.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections.abc import Iterable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing.reductions as reductions  # also registers torch's ForkingPickler reducers
from torch import Tensor

from miles.backends.sglang_utils.weight_sync.buckets import (
    FlattenedBucket,
    NamedTensors,
    TensorMeta,
)

# Every global a payload may name: torch's rebuild functions and the classes and dtypes they take.
_ALLOWED_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch", "UntypedStorage"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),  # CUDA IPC names the tensor's typed storage class
}
_FLATTENED_KEYS = {"flat", "metadata"}


def share_tensor(tensor: Tensor) -> Tensor:
    """`tensor` in memory another process on this host can map, copying only when needed.

    CPU tensors not yet in shared memory are copied into a fresh /dev/shm segment, so the caller's
    own storage (possibly a live parameter) is never moved; CUDA tensors and tensors already in
    shared memory are returned as they are. Share a bucket once, then serialize it per engine.
    """
    tensor = tensor.detach()
    if tensor.is_cuda or tensor.is_shared() or tensor.numel() == 0:
        return tensor
    if tensor.device.type != "cpu":
        raise ValueError(
            f"cannot share a tensor on {tensor.device} through /update_weights_from_tensor; "
            "move it to cpu or cuda first"
        )
    storage = torch.UntypedStorage._new_using_filename_cpu(tensor.numel() * tensor.element_size())
    shared = torch.empty(0, dtype=tensor.dtype).set_(storage, 0, tensor.shape)
    shared.copy_(tensor)
    return shared


def serialize_named_tensors(named_tensors: Iterable[tuple[str, Tensor]]) -> str:
    """An ascii payload holding handles to `named_tensors` (SGLang's plain list-of-pairs form).

    The payload is single-use: deserialize it exactly once, and keep the tensors (or the process
    that shared them) alive until the receiver has loaded them. A segment is unlinked when sender
    and receiver have both dropped it; a receiver that exits still holding it leaves it until the
    sender's process ends (torch_shm_manager removes it then).
    """
    return _dumps([(str(name), share_tensor(tensor)) for name, tensor in named_tensors])


def deserialize_named_tensors(payload: str) -> NamedTensors:
    """The `(name, tensor)` pairs of a `serialize_named_tensors` payload, mapped, not copied."""
    obj = _loads(payload)
    if not isinstance(obj, list) or not all(_is_named_tensor(item) for item in obj):
        raise ValueError(
            "payload is not a list of (name, tensor) pairs; was it made by "
            "serialize_flattened_bucket? Then send load_format='flattened_bucket'"
        )
    return [(name, tensor) for name, tensor in obj]


def serialize_flattened_bucket(bucket: FlattenedBucket) -> str:
    """An ascii payload for `load_format="flattened_bucket"`: shared flat tensors + plain metadata.

    A flattened bucket owns its flat tensors (`flatten_bucket` made them), so CPU ones move into
    shared memory in place rather than being copied again; serializing the same bucket for more
    engines shares nothing twice. Metadata travels as plain tuples so the receiver needs no miles
    class; unlike SGLang's own flattened_bucket payload (one dtype, its class) it may mix dtypes.
    """
    obj = {
        "flat": {key: flat.detach() for key, flat in bucket.flat.items()},
        "metadata": [(m.name, m.dtype, tuple(m.shape), m.offset, m.numel) for m in bucket.metadata],
    }
    return _dumps(obj)


def deserialize_flattened_bucket(payload: str) -> FlattenedBucket:
    """The `FlattenedBucket` of a `serialize_flattened_bucket` payload; flat tensors are mapped."""
    obj = _loads(payload)
    if not isinstance(obj, dict) or set(obj) != _FLATTENED_KEYS:
        raise ValueError(
            f"payload is not a flattened bucket (a dict with keys {sorted(_FLATTENED_KEYS)}); "
            "was it made by serialize_named_tensors? Then send load_format=None"
        )
    flat, metadata = obj["flat"], obj["metadata"]
    if not isinstance(flat, dict) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in flat.items()
    ):
        raise ValueError("flattened bucket 'flat' must map dtype names to tensors")
    try:
        metas = [
            TensorMeta(str(n), str(d), tuple(int(x) for x in s), int(o), int(c))
            for n, d, s, o, c in metadata
        ]
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"flattened bucket metadata must be (name, dtype, shape, offset, numel) tuples: {err}"
        ) from None
    return FlattenedBucket(flat=flat, metadata=metas)


def _is_named_tensor(item: Any) -> bool:
    return (
        isinstance(item, tuple | list)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], Tensor)
    )


def _reduce_storage_by_filename(storage: torch.UntypedStorage) -> tuple:
    """torch's `file_system` storage reduction, applied to one pickler instead of the process.

    `torch.multiprocessing.set_sharing_strategy` is process-wide, so setting it would change how
    every other pickler in the trainer (data loaders, Ray) shares memory; this reducer does not.
    """
    if storage.nbytes() == 0:
        return (reductions.rebuild_storage_empty, (type(storage),))
    manager, handle, nbytes = storage._share_filename_cpu_()
    # The payload owns one reference until the receiver's rebuild drops it, so the segment
    # outlives the sender's own tensor if that is freed before the receiver maps it.
    storage._shared_incref()
    return (reductions.rebuild_storage_filename, (type(storage), manager, handle, nbytes))


def _dumps(obj: Any) -> str:
    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table[torch.UntypedStorage] = _reduce_storage_by_filename
    pickler.dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class _HandleUnpickler(pickle.Unpickler):
    """Refuses every global but torch's rebuild functions, so a payload cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a payload")
        if name == "rebuild_cuda_tensor" and not torch.cuda.is_available():
            raise pickle.UnpicklingError(
                "the payload holds CUDA IPC handles but this process sees no CUDA device"
            )
        return super().find_class(module, name)


def _loads(payload: str) -> Any:
    if not isinstance(payload, str | bytes):
        raise ValueError(f"payload must be a base64 string, got {type(payload).__name__}")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(
            f"payload is not valid base64 ({err}); send serialize_*() output as is"
        ) from None
    try:
        return _HandleUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, TypeError, AttributeError) as err:
        raise ValueError(f"payload is not a weight-sync pickle: {err}") from None
    except RuntimeError as err:
        # Opening a segment fails when it is gone: the sender freed it, the payload was already
        # used once, or the sender runs on another host (shared memory is host-local).
        raise ValueError(
            f"cannot map the payload's shared memory ({err}); deserialize each payload once, on "
            "the sender's host, while the sender still holds the tensors"
        ) from None
