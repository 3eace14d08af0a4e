"""torch.profiler traces of a train rank (--profile-target train), started and stopped by the
driver between two of the rank's calls.

The functions run inside the rank's process (`actor.__ray_call__`): the train actor's code needs
no hook. A Ray actor runs its calls on one thread, so the profiler sees every call between start
and stop. The trace is Chrome's trace-event JSON (`*.pt.trace.json`), which Perfetto and
TensorBoard's profiler plugin open.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_running: dict[str, Any] = {}  # this process's profiler, between start and stop


def start_trace(_actor: Any = None) -> None:
    """Start profiling this process: CPU ops, and the GPU's kernels where there is one."""
    import torch

    if "profiler" in _running:
        raise RuntimeError("a torch.profiler trace is already running in this process")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities, record_shapes=True)
    profiler.start()
    _running["profiler"] = profiler


def stop_trace(_actor: Any = None, *, path: str) -> str:
    """Stop the trace started by `start_trace` and write it to `path`; returns the path."""
    profiler = _running.pop("profiler", None)
    if profiler is None:
        raise RuntimeError("no torch.profiler trace runs in this process: start_trace() first")
    profiler.stop()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(path)
    return path
