"""The per-phase peak memory record of a run (--memory-snapshot-dir): which process needed how
much resident memory in which phase of which rollout.

The driver marks the phases of the loop (`PhaseTimeline`: start-up, generate, train, update
weights, ...) and the samplers (`peak_rss.PeakRssSampler`, one per node) time-stamp every window's
peak, closing a window at each phase change too; `phase_peaks` joins the two. In the one-step-async loops a phase is the driver's: the
engines' peak under `train` includes the next rollout's generation that overlaps it.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterable
from pathlib import Path

from miles.utils.observability.peak_rss import Sample

RECORD_FILE = "peak_rss.jsonl"
STARTUP = "startup"
_MB = 1024 * 1024


def phase_name(label: str) -> str:
    """A phase as a metric-friendly name: "update weights" -> "update_weights"."""
    return re.sub(r"\W+", "_", label.strip().lower()).strip("_")


class PhaseTimeline:
    """When each phase of the driver's loop began (Unix time), from the start-up on."""

    def __init__(self, began_at: float) -> None:
        self._starts: list[float] = [began_at]
        self._phases: list[tuple[str, int | None]] = [(STARTUP, None)]

    def mark(self, name: str, rollout_id: int | None, at: float) -> None:
        if self._phases[-1] != (phase_name(name), rollout_id):
            self._starts.append(at)
            self._phases.append((phase_name(name), rollout_id))

    def phase_at(self, at: float) -> str:
        index = bisect.bisect_right(self._starts, at) - 1
        return self._phases[max(index, 0)][0]


def phase_peaks(samples: Iterable[Sample], timeline: PhaseTimeline) -> dict[tuple[str, str], int]:
    """{(process, phase): peak bytes}; a window counts for the phase it ends in. The samplers
    close a window at every phase change (stamped just before it), so even a phase shorter than
    the sampling interval has a window of its own."""
    peaks: dict[tuple[str, str], int] = {}
    for at, values in samples:
        phase = timeline.phase_at(at)
        for process, value in values.items():
            key = (process, phase)
            peaks[key] = max(peaks.get(key, 0), value)
    return peaks


def record_lines(rollout_id: int, peaks: dict[tuple[str, str], int]) -> list[dict]:
    """One record line per process and phase of `rollout_id`."""
    return [
        {"rollout_id": rollout_id, "process": process, "phase": phase,
         "peak_rss_mb": round(value / _MB, 1)}
        for (process, phase), value in sorted(peaks.items())
    ]  # fmt: skip


def rollout_metrics(peaks: dict[tuple[str, str], int]) -> dict[str, float]:
    """`memory/<process>/peak_rss_mb`: each process's peak over the rollout's phases."""
    by_process: dict[str, int] = {}
    for (process, _), value in peaks.items():
        by_process[process] = max(by_process.get(process, 0), value)
    return {f"memory/{p}/peak_rss_mb": round(v / _MB, 1) for p, v in sorted(by_process.items())}


def append_record(directory: str | Path, lines: list[dict]) -> None:
    path = Path(directory) / RECORD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as sink:
        sink.writelines(json.dumps(line) + "\n" for line in lines)


def read_record(directory: str | Path) -> list[dict]:
    path = Path(directory) / RECORD_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
