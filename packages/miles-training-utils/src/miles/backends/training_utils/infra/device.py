"""Which accelerator this process uses, and the few device operations the rest of miles needs.

This is the only module in miles that branches on the device kind (architecture.md: "Devices"):
everything else asks it for a `torch.device`, the distributed backend name, a synchronisation point
or a memory report.
ROCm builds of PyTorch expose AMD GPUs through the `cuda` device type, so "rocm" differs from
"cuda" only in what it reports and in which vendor library measures device memory.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import resource
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.distributed as dist

from miles.backends.training_utils.infra.vendor_libs import amdsmi_usable

logger = logging.getLogger(__name__)

DeviceKind = Literal["cpu", "cuda", "rocm", "npu"]
DEVICE_KINDS: tuple[str, ...] = get_args(DeviceKind)

# Overrides detection, e.g. MILES_DEVICE=cpu to run on the CPU of a GPU machine.
DEVICE_ENV_VAR = "MILES_DEVICE"

_DIST_BACKEND: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "rocm": "nccl", "npu": "hccl"}
# torch's device type per kind: ROCm reuses "cuda", Ascend registers "npu" through torch_npu.
_TORCH_DEVICE_TYPE: dict[str, str] = {"cpu": "cpu", "cuda": "cuda", "rocm": "cuda", "npu": "npu"}


@dataclass(frozen=True)
class DeviceInfo:
    """The accelerator this process trains or serves on."""

    kind: DeviceKind
    """cpu, cuda, rocm or npu."""
    count: int
    """Devices visible to this process (1 for cpu: the process itself is the worker)."""

    @property
    def torch_device_type(self) -> str:
        return _TORCH_DEVICE_TYPE[self.kind]

    @property
    def dist_backend(self) -> str:
        """torch.distributed backend for collectives between ranks on this device kind."""
        return _DIST_BACKEND[self.kind]

    @property
    def is_accelerator(self) -> bool:
        return self.kind != "cpu"


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        importlib.import_module("torch_npu")  # registers torch.npu
    except (ImportError, OSError) as err:
        # torch-npu installed where the CANN libraries it links (libhccl.so, ...) are missing:
        # not an Ascend host, or its toolkit's environment is not set.
        logger.warning(
            "torch_npu is installed but cannot load (%s: %s): no Ascend NPU will be used. On an "
            "Ascend host, source the CANN toolkit's set_env.sh; elsewhere, uninstall torch-npu",
            type(err).__name__, err,
        )  # fmt: skip
        return False
    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def _accelerator_count(kind: str) -> int:
    if kind == "npu":
        return int(torch.npu.device_count())  # type: ignore[attr-defined]
    if kind in ("cuda", "rocm"):
        return torch.cuda.device_count()
    return 1


def detect_device_kind() -> DeviceKind:
    """The device kind of this machine, or the one forced by $MILES_DEVICE."""
    forced = os.environ.get(DEVICE_ENV_VAR, "").strip().lower()
    if forced:
        if forced not in DEVICE_KINDS:
            raise ValueError(
                f"${DEVICE_ENV_VAR}={forced!r} is not a device kind; use one of {', '.join(DEVICE_KINDS)} "
                "or unset it to detect the device"
            )
        return forced  # type: ignore[return-value]
    if _npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "rocm" if torch.version.hip else "cuda"
    return "cpu"


@functools.cache
def get_device_info() -> DeviceInfo:
    """Detected once per process; call `get_device_info.cache_clear()` after changing $MILES_DEVICE."""
    kind = detect_device_kind()
    return DeviceInfo(kind=kind, count=_accelerator_count(kind))


def dist_backend() -> str:
    """gloo on CPU, nccl on CUDA and ROCm (RCCL answers to the nccl name), hccl on Ascend."""
    return get_device_info().dist_backend


def get_torch_device(local_rank: int = 0) -> torch.device:
    """The torch.device a rank should place its tensors on."""
    info = get_device_info()
    if not info.is_accelerator:
        return torch.device("cpu")
    if not 0 <= local_rank < info.count:
        raise ValueError(
            f"local rank {local_rank} has no {info.kind} device: this process sees {info.count}; "
            "check the number of workers per node against the visible devices"
        )
    return torch.device(info.torch_device_type, local_rank)


def set_device(local_rank: int = 0) -> torch.device:
    """Make `local_rank`'s device current, so collectives and default allocations land there."""
    device = get_torch_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "npu":
        torch.npu.set_device(device)  # type: ignore[attr-defined]
    return device


def current_device() -> torch.device:
    """The device this process made current with `set_device` (cpu on CPU)."""
    info = get_device_info()
    if info.kind in ("cuda", "rocm"):
        return torch.device("cuda", torch.cuda.current_device())
    if info.kind == "npu":
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")


def collective_device(group=None) -> torch.device:
    """Where a tensor must live for a collective over `group` (None: the default group): the CPU
    for gloo, this rank's current accelerator for nccl / hccl (which take no CPU tensors)."""

    if dist.get_backend(group) == dist.Backend.GLOO:
        return torch.device("cpu")
    return current_device()


def synchronize() -> None:
    """Wait for queued device work; a no-op on CPU, where every op is synchronous."""
    kind = get_device_info().kind
    if kind in ("cuda", "rocm"):
        torch.cuda.synchronize()
    elif kind == "npu":
        torch.npu.synchronize()  # type: ignore[attr-defined]


def empty_cache() -> None:
    """Hand cached allocator blocks back to the device (after offloading, before an engine wakes)."""
    kind = get_device_info().kind
    if kind in ("cuda", "rocm"):
        torch.cuda.empty_cache()
    elif kind == "npu":
        torch.npu.empty_cache()  # type: ignore[attr-defined]


@dataclass(frozen=True)
class MemoryReport:
    """Memory in bytes. On CPU, "allocated" is this process's resident set."""

    allocated: int
    """Held by live tensors (cpu: resident set size of the process)."""
    reserved: int
    """Held by the caching allocator, including free cached blocks (cpu: same as allocated)."""
    peak_allocated: int
    """High-water mark of `allocated` since start or the last reset (cpu: peak RSS)."""
    device_used: int | None
    """Used on the whole device by every process, as nvidia-smi / amd-smi show it; None on CPU or
    when the vendor library (the [cuda] / [rocm] extra) is not installed."""
    device_total: int | None
    """Capacity of the device; None on CPU."""

    def as_gib(self) -> dict[str, float | None]:
        gib = float(1 << 30)
        return {k: (None if v is None else v / gib) for k, v in self.__dict__.items()}


def _cpu_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _vendor_library_available(kind: str) -> bool:
    # torch.cuda.device_memory_used reads NVML (nvidia-ml-py) or AMD SMI (amdsmi); an amdsmi that
    # cannot load its ROCm library counts as absent (vendor_libs says why, once).
    if kind == "rocm":
        return amdsmi_usable()
    return kind == "cuda" and importlib.util.find_spec("pynvml") is not None


def memory_report(local_rank: int = 0) -> MemoryReport:
    """Memory of this process on its device, and of the whole device where it can be measured."""
    info = get_device_info()
    if info.kind == "cpu":
        rss = _cpu_rss_bytes()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        return MemoryReport(rss, rss, max(peak, rss), None, None)
    device = get_torch_device(local_rank)
    backend = torch.npu if info.kind == "npu" else torch.cuda  # type: ignore[attr-defined]
    _, total = backend.mem_get_info(device)
    used = None
    if info.kind in ("cuda", "rocm") and _vendor_library_available(info.kind):
        used = int(torch.cuda.device_memory_used(device))
    return MemoryReport(
        allocated=int(backend.memory_allocated(device)),
        reserved=int(backend.memory_reserved(device)),
        peak_allocated=int(backend.max_memory_allocated(device)),
        device_used=used,
        device_total=int(total),
    )


def reset_peak_memory(local_rank: int = 0) -> None:
    """Restart the peak counter of `memory_report`; on CPU the kernel's peak RSS cannot be reset."""
    info = get_device_info()
    if info.kind in ("cuda", "rocm"):
        torch.cuda.reset_peak_memory_stats(get_torch_device(local_rank))
    elif info.kind == "npu":
        torch.npu.reset_peak_memory_stats(get_torch_device(local_rank))  # type: ignore[attr-defined]
