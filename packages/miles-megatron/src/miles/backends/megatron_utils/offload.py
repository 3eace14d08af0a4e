"""Sleep / wake-up for the Megatron backend: free device memory while every tensor alias survives.

Megatron's DDP keeps parameters and gradients as views into flat buffers, and the distributed
optimizer's float32 shards can be views into the same buffers. `module.to("cpu")` or `p.data = ...`
gives the moved tensors new storage and silently cuts those views loose: the optimizer would then
update tensors the model no longer reads. Resizing a *storage* to zero bytes frees its device memory
while every view keeps pointing at the same storage object; resizing it back and copying the saved
bytes in restores all of them at once. Megatron's own grad-buffer offload works the same way.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass
class _Region:
    storage: torch.UntypedStorage
    nbytes: int
    keep: bool  # False: contents not worth saving (gradients); they come back zero-filled


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (a view: writes land in the storage)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _storage_id(storage: torch.UntypedStorage) -> int:
    # The address of the StorageImpl every view shares: stable across resize_, unlike data_ptr().
    return storage._cdata


class StorageOffloader:
    """Frees the device memory behind given tensors and brings it back, contents intact.

    `offload(keep, discard)`: `keep` tensors (parameters, optimizer state) are copied to host memory
    first; `discard` tensors (gradient buffers) come back zero-filled. Tensors sharing a storage are
    handled once; tensors not on `device` (e.g. a CPU step counter) are left alone. The tensors are
    passed at every offload because optimizer state appears lazily, at the first step. Host copies
    are kept between offloads (pinned when the device is a GPU, so the copies run asynchronously).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._regions: list[_Region] = []
        self._host: dict[int, torch.Tensor] = {}
        self.offloaded = False

    @property
    def nbytes(self) -> int:
        """Device bytes the last offload freed."""
        return sum(r.nbytes for r in self._regions)

    def _collect(self, keep: Iterable[torch.Tensor], discard: Iterable[torch.Tensor]) -> None:
        regions: dict[int, _Region] = {}
        for tensors, kept in ((keep, True), (discard, False)):
            for tensor in tensors:
                if tensor is None or tensor.device != self.device:
                    continue
                storage = tensor.untyped_storage()
                key = _storage_id(storage)
                if storage.nbytes() > 0 and key not in regions:
                    regions[key] = _Region(storage, storage.nbytes(), kept)
        self._regions = list(regions.values())
        self._host = {k: v for k, v in self._host.items() if k in regions}

    def offload(self, keep: Iterable[torch.Tensor], discard: Iterable[torch.Tensor] = ()) -> None:
        if self.offloaded:
            raise RuntimeError("offload() twice: the device copies are already freed")
        self._collect(keep, discard)
        pin = self.device.type == "cuda"
        for region in self._regions:
            if not region.keep:
                continue
            key = _storage_id(region.storage)
            host = self._host.get(key)
            if host is None or host.numel() != region.nbytes:
                host = self._host[key] = torch.empty(
                    region.nbytes, dtype=torch.uint8, pin_memory=pin
                )
            host.copy_(_bytes_of(region.storage), non_blocking=pin)
        # The copies must land before their source memory is released.
        _synchronize(self.device)
        for region in self._regions:
            region.storage.resize_(0)
        _empty_cache(self.device)
        self.offloaded = True
        logger.info("offloaded %.1f MiB from %s", self.nbytes / 2**20, self.device)

    def reload(self) -> None:
        if not self.offloaded:
            raise RuntimeError("reload() without offload(): the device copies are in place")
        for region in self._regions:
            region.storage.resize_(region.nbytes)
            target = _bytes_of(region.storage)
            if region.keep:
                target.copy_(self._host[_storage_id(region.storage)], non_blocking=True)
            else:
                target.zero_()
        _synchronize(self.device)
        self.offloaded = False

    @contextlib.contextmanager
    def visiting(self, tensors: Iterable[torch.Tensor]) -> Iterator[None]:
        """While offloaded, bring back the storages behind `tensors` for reading in the block, then
        free them again (e.g. to send the weights to colocated engines from a sleeping trainer).
        Writes made in the block are lost."""
        if not self.offloaded:
            raise RuntimeError("visiting() needs offloaded state; the tensors are already in place")
        wanted = {_storage_id(t.untyped_storage()) for t in tensors}
        regions = [r for r in self._regions if _storage_id(r.storage) in wanted]
        for region in regions:
            region.storage.resize_(region.nbytes)
            if region.keep:
                _bytes_of(region.storage).copy_(
                    self._host[_storage_id(region.storage)], non_blocking=True
                )
            else:
                _bytes_of(region.storage).zero_()
        _synchronize(self.device)
        try:
            yield
        finally:
            _synchronize(self.device)
            for region in regions:
                region.storage.resize_(0)
            _empty_cache(self.device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
