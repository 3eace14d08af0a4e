"""CUDA memory history of a train rank (--memory-snapshot-dir on GPUs): every allocation and
free with its stack, dumped as a snapshot that https://pytorch.org/memory_viz reads.

Like `torch_trace`, these run inside the rank's process through `actor.__ray_call__`. The
history starts once the rank is built, so the model's and optimizer's buffers show in the
snapshot as blocks without their allocation stacks. An out-of-memory error dumps a snapshot too.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Allocation events kept (the oldest drop out): about a minute of a busy step's history.
_MAX_ENTRIES = 100_000


def start_history(_actor: Any = None, *, oom_path: str) -> bool:
    """Record this process's CUDA allocations; False where the process has no GPU."""
    import torch

    if not torch.cuda.is_available():
        return False
    torch.cuda.memory._record_memory_history(max_entries=_MAX_ENTRIES)

    def on_oom(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        logger.error("CUDA out of memory on device %d; memory snapshot in %s", device, oom_path)
        torch.cuda.memory._dump_snapshot(oom_path)

    torch._C._cuda_attach_out_of_memory_observer(on_oom)
    return True


def dump_snapshot(_actor: Any = None, *, path: str, stop: bool = True) -> str | None:
    """Write the allocation history to `path` (a pickle), and end it with `stop`."""
    import torch

    if not torch.cuda.is_available():
        return None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(path)
    if stop:
        torch.cuda.memory._record_memory_history(enabled=None)
    return path
