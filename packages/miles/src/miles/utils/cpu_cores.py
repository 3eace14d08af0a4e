"""How many cores this process can use: its CPU affinity, capped by its cgroup's CPU quota.

One answer for the torch threads a run gives its processes (`miles.ray.cpu_threads`) and for
the benchmarks that measure the machine (`bench/compute_floor.py`, `bench/sweep.py`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), fewer where a cgroup's CPU quota
    allows less: a container limited to 2 CPUs on a 64-core host sees all 64 in its affinity,
    and threads sized to them would take turns on 2."""
    if hasattr(os, "sched_getaffinity"):  # Linux: the cores this process may run on
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


CGROUP_ROOT = "/sys/fs/cgroup"


def cgroup_cpu_quota(
    root: str = CGROUP_ROOT, membership: str = "/proc/self/cgroup"
) -> float | None:
    """CPUs this process's cgroups allow per period (quota / period, the tightest limit on the
    way from its own cgroup to the root), or None without a limit. cgroup v2: each directory's
    `cpu.max` ("max 100000": none; "200000 100000": 2 CPUs); v1: `cpu/cpu.cfs_quota_us` (-1:
    none) over `cpu/cpu.cfs_period_us`."""
    limits, seen_v2 = [], False
    for directory in _own_cgroup_and_ancestors(root, membership):
        try:
            quota, period = Path(directory, "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        seen_v2 = True
        if quota != "max":
            limits.append(int(quota) / int(period))
    if not seen_v2:
        try:
            quota_us = int(Path(root, "cpu", "cpu.cfs_quota_us").read_text())
            period_us = int(Path(root, "cpu", "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            return None
        if quota_us > 0 and period_us > 0:
            limits.append(quota_us / period_us)
    return min(limits) if limits else None


def _own_cgroup_and_ancestors(root: str, membership: str) -> list[str]:
    """This process's cgroup v2 directory (the "0::/path" line of /proc/self/cgroup) and each
    directory above it, up to `root`."""
    try:
        lines = Path(membership).read_text().splitlines()
    except OSError:
        lines = []
    path = next((line[3:].strip("/") for line in lines if line.startswith("0::")), "")
    parts = [part for part in path.split("/") if part]
    return [os.path.join(root, *parts[:depth]) for depth in range(len(parts), -1, -1)]
