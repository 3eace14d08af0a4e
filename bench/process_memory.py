"""Peak resident memory of a benchmark's processes: a miles run's driver, rollout manager,
engines and train ranks, found by pid while the run lives, or any process by pid (Linux only).
Ray's own daemons (GCS, raylet, dashboard) are left out: they are the same for any workload.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def miles_processes(run: Any) -> dict[str, list[int]]:
    """{label: pids} of the run's processes: this driver, the rollout manager, each engine's
    server with its child processes, each train rank (Ray's own daemons left out)."""
    import ray

    from miles.utils.observability.peak_rss import process_tree

    found = {"driver": [os.getpid()]}
    for label, (pid, _node) in ray.get(run.rollout_manager.process_ids.remote()).items():
        found[label] = process_tree(pid) if label.startswith("engine_") else [pid]
    # A lambda, which Ray pickles by value: the rank's process cannot import this bench module.
    own_pid = lambda _actor: os.getpid()  # noqa: E731
    ranks = ray.get([actor.__ray_call__.remote(own_pid) for actor in run.trainers.actors])
    found.update({f"train_rank_{rank}": [pid] for rank, pid in enumerate(ranks)})
    return found


def peak_rss_mb_of(pids: list[int]) -> float:
    """The sum of the processes' peak resident memory over their lives (VmHWM), MB (Linux)."""
    total_kb = 0
    for pid in pids:
        status = Path(f"/proc/{pid}/status").read_text()
        total_kb += next(int(line.split()[1]) for line in status.splitlines()
                         if line.startswith("VmHWM:"))  # fmt: skip
    return total_kb / 1024
