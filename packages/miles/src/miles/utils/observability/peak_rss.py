"""Peak resident memory of processes, sampled without missing a spike between two samples.

Linux keeps each process's peak resident set (VmHWM in /proc/<pid>/status), and writing 5 to
/proc/<pid>/clear_refs sets it back to the current size. Reading it and resetting it at every
sample gives each window's true peak, however short the spike. Where the reset is not allowed
(another user's process, a hardened kernel) the sample is the current size (VmRSS), so a spike
shorter than --interval can be missed. Linux only: elsewhere nothing is sampled.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

Sample = tuple[float, dict[str, int]]
"""(Unix time at the window's end, {process label: peak bytes in the window})."""


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (an engine server's scheduler processes, say)."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        try:
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        queue.extend(int(child) for child in children)
    return found


class PeakReader:
    """Each watched pid's peak resident bytes since the last read."""

    def __init__(self) -> None:
        self._cannot_reset: set[int] = set()

    def read(self, pid: int) -> int | None:
        """Peak bytes since the last read (None: the process is gone)."""
        try:
            fields = _status_fields(pid)
        except OSError:
            return None
        if pid in self._cannot_reset:
            return fields.get("VmRSS")
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            self._cannot_reset.add(pid)
            logger.info("cannot reset the peak memory of pid %d; sampling its current size", pid)
            return fields.get("VmRSS")
        return fields.get("VmHWM")


def _status_fields(pid: int) -> dict[str, int]:
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            values[key] = int(rest.split()[0]) * 1024  # kB
    return values


class PeakRssSampler:
    """A daemon thread sampling the peaks of labelled processes every `interval_s`; a label
    with `tree` counts the sum of its process tree's peaks."""

    def __init__(self, interval_s: float = 0.25) -> None:
        if not interval_s > 0:
            raise ValueError(f"the sampling interval must be positive, got {interval_s}")
        self.interval_s = interval_s
        self._watched: dict[str, tuple[int, bool]] = {}
        self._samples: list[Sample] = []
        self._reader = PeakReader()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watch(self, label: str, pid: int, *, tree: bool = False) -> None:
        """Sample `pid` (and with `tree` its descendants) as `label` from now on. The first
        reading is the process's peak since it began: it is stamped 0.0, before any phase."""
        with self._lock:
            known = self._watched.get(label) == (pid, tree)
            self._watched[label] = (pid, tree)
            if not known:
                first = self._peak(pid, tree)
                if first is not None:
                    self._samples.append((0.0, {label: first}))

    def sample(self, stamp: float | None = None) -> None:
        """Close the current window now, stamped `stamp` (default: now)."""
        self._sample(stamp)

    def drain(self) -> list[Sample]:
        """Every sample since the last drain, oldest first (and one taken now)."""
        self._sample()
        with self._lock:
            samples, self._samples = self._samples, []
        return samples

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self, stamp: float | None = None) -> None:
        with self._lock:
            peaks = {}
            for label, (pid, tree) in self._watched.items():
                peak = self._peak(pid, tree)
                if peak is not None:
                    peaks[label] = peak
            if peaks:
                self._samples.append((time.time() if stamp is None else stamp, peaks))

    def _peak(self, pid: int, tree: bool) -> int | None:
        values = [self._reader.read(p) for p in (process_tree(pid) if tree else [pid])]
        known = [v for v in values if v is not None]
        return sum(known) if known else None
