"""The memory record's samplers on the cluster: one `NodeMemoryWatch` Ray actor per node that runs
a process of the run, sampling the processes of its node (/proc is per node).

`RunMemory` (in the driver) finds the run's processes, starts the watches, and once per rollout
drains them into the record (`miles.utils.observability.memory_record`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import ray
from miles.utils.observability import memory_record
from miles.utils.observability.peak_rss import PeakRssSampler, Sample
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

logger = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 0.25
# A phase's closing window is stamped this much before the next phase began.
_BEFORE_S = 1e-6
Processes = dict[str, tuple[int, str]]
"""{process label: (pid, Ray node id)}."""


class NodeMemoryWatch:
    """Ray actor: the peaks of the run's processes on this node, every SAMPLE_INTERVAL_S."""

    def __init__(self) -> None:
        self._sampler = PeakRssSampler(SAMPLE_INTERVAL_S)
        self._sampler.start()

    def watch(self, processes: dict[str, int]) -> None:
        """Sample these processes (an engine_* label counts its server's child processes)."""
        for label, pid in processes.items():
            self._sampler.watch(label, pid, tree=label.startswith("engine_"))

    def mark(self, stamp: float) -> None:
        """A phase ends: close the window, stamped `stamp` (the driver's clock, just before
        the next phase began)."""
        self._sampler.sample(stamp)

    def drain(self) -> list[Sample]:
        return self._sampler.drain()

    def stop(self) -> None:
        self._sampler.stop()


class RunMemory:
    """The per-phase peak memory record of a run, written to `directory`."""

    def __init__(self, directory: str, timeline: memory_record.PhaseTimeline) -> None:
        self.directory = Path(directory)
        self.timeline = timeline
        self._watches: dict[str, Any] = {}  # node id -> NodeMemoryWatch

    def watch(self, processes: Processes) -> None:
        """Start (or move, after an engine restart) the sampling of `processes`."""
        by_node: dict[str, dict[str, int]] = {}
        for label, (pid, node) in processes.items():
            by_node.setdefault(node, {})[label] = pid
        for node, pids in by_node.items():
            if node not in self._watches:
                strategy = NodeAffinitySchedulingStrategy(node, soft=False)
                actor = ray.remote(NodeMemoryWatch).options(
                    num_cpus=0, scheduling_strategy=strategy
                )
                self._watches[node] = actor.remote()
            self._watches[node].watch.remote(pids)

    def phase(self, name: str, rollout_id: int | None, at: float) -> None:
        """The loop enters phase `name` at `at`: every sampler closes its window (no wait)."""
        self.timeline.mark(name, rollout_id, at)
        for watch in self._watches.values():
            watch.mark.remote(at - _BEFORE_S)

    def finish_rollout(self, rollout_id: int) -> dict[str, float]:
        """Record the peaks of every process and phase since the last call; the rollout's
        `memory/<process>/peak_rss_mb` metrics."""
        samples = [s for batch in ray.get([w.drain.remote() for w in self._watches.values()])
                   for s in batch]  # fmt: skip
        peaks = memory_record.phase_peaks(samples, self.timeline)
        memory_record.append_record(self.directory, memory_record.record_lines(rollout_id, peaks))
        return memory_record.rollout_metrics(peaks)

    def close(self) -> None:
        for watch in self._watches.values():
            try:
                ray.get(watch.stop.remote(), timeout=10)
            except Exception as err:  # a node that went away: its watch went with it
                logger.warning("stopping a memory watch: %s", err)
            ray.kill(watch)
        self._watches = {}
