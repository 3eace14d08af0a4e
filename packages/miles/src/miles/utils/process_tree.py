"""Processes named by pid *and* start time, read from /proc: a pid alone may be reused by an
unrelated process once its owner exits, so nothing here signals a pid whose start time changed.

Used to stop every process a local Ray instance started (`miles.ray.local_ray`), including the
ones Ray itself leaves behind when its raylet dies. Linux only (/proc); elsewhere every function
sees no process and the callers fall back to Ray's own shutdown.
"""

from __future__ import annotations

import os
import signal
import time

ProcessKey = tuple[int, int]
"""(pid, start time in clock ticks since boot): one process, never a later one with its pid."""


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of `pid`, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses; start time is field 22.
    fields = stat.rpartition(")")[2].split()
    return fields[0], int(fields[1]), int(fields[19])


def key_of(pid: int) -> ProcessKey | None:
    """`pid` with its start time, or None when it is not running."""
    stat = _stat(pid)
    return None if stat is None else (pid, stat[2])


def is_alive(key: ProcessKey) -> bool:
    """Whether this very process still runs (a zombie does not count)."""
    stat = _stat(key[0])
    return stat is not None and stat[2] == key[1] and stat[0] not in ("Z", "X")


def descendants(roots: list[ProcessKey]) -> set[ProcessKey]:
    """The live `roots` and every live process below them (children, their children, ...)."""
    children: dict[int, list[ProcessKey]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for entry in entries:
        if entry.isdigit() and (stat := _stat(int(entry))) is not None and stat[0] != "Z":
            children.setdefault(stat[1], []).append((int(entry), stat[2]))
    found: set[ProcessKey] = set()
    todo = [root for root in roots if is_alive(root)]
    while todo:
        key = todo.pop()
        if key not in found:
            found.add(key)
            todo.extend(children.get(key[0], []))
    return found


def kill_all(keys: set[ProcessKey], *, wait_s: float = 5.0) -> set[ProcessKey]:
    """SIGKILL each process of `keys` still running; wait up to `wait_s` for them to be gone.
    Returns those still running (not ours to reap: e.g. a process stuck in the kernel)."""
    for key in keys:
        if is_alive(key):
            try:
                os.kill(key[0], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + wait_s
    left = {key for key in keys if is_alive(key)}
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {key for key in left if is_alive(key)}
    return left
