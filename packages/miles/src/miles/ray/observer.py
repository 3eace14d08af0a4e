"""`RunObserver`: the profiling window and the memory record of a run, driven by the loop's phases
(architecture.md: "Observability").

`Run` tells it each phase as the loop enters it and each rollout as it is logged; it starts and
stops the profilers of --profile-target over rollouts --profile-step-start .. --profile-step-end - 1
and, with --memory-snapshot-dir, records each process's peak memory per phase and takes the train
ranks' CUDA snapshots. The train ranks are reached through `__ray_call__`, so neither the train
actor nor the train group carries observability code.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import ray
from miles.ray.memory_watch import Processes, RunMemory
from miles.ray.train_group import RayTrainGroup
from miles.utils.observability import cuda_memory, torch_trace
from miles.utils.observability.config import ObservabilityConfig
from miles.utils.observability.memory_record import PhaseTimeline

logger = logging.getLogger(__name__)

PROFILES_DIR = "profiles"
# Starting or stopping a profiler, or dumping a snapshot, takes seconds at most.
_CALL_TIMEOUT_S = 300.0


class RunObserver:
    def __init__(
        self,
        settings: ObservabilityConfig,
        output_dir: str,
        *,
        trainers: RayTrainGroup | None,
        rollout_manager: Any,
        began_at: float,
        critics: RayTrainGroup | None = None,
    ) -> None:
        """`critics`: the ranks of a critic of its own, recorded and profiled beside the
        policy's as `critic_rank_<r>`."""
        self.settings = settings
        self.trainers = trainers
        self.critics = critics
        self.rollout_manager = rollout_manager
        self.profile_dir = Path(output_dir) / PROFILES_DIR
        self._profiled: tuple[int, int] | None = None  # the window's rollouts, while it runs
        self._profile_done = False
        self._cuda_history = False
        self.memory: RunMemory | None = None
        if settings.records_memory:
            assert settings.memory_snapshot_dir is not None
            self.memory = RunMemory(settings.memory_snapshot_dir, PhaseTimeline(began_at))
            self.memory.watch(self._processes())
            self._start_cuda_history()

    # -- hooks the run calls --------------------------------------------------------------------

    def phase(self, name: str, rollout_id: int | None) -> None:
        """The loop enters phase `name` (of rollout `rollout_id`, where it has one)."""
        if self.memory is not None:
            self.memory.phase(name, rollout_id, time.time())
        start, end = self.settings.profile_step_start, self.settings.profile_step_end
        due = rollout_id is not None and start <= rollout_id < end
        if self.settings.profiles and due and not self._profile_done and self._profiled is None:
            self._start_profiles(rollout_id, end - 1)

    def finish_rollout(self, rollout_id: int) -> dict[str, float]:
        """Rollout `rollout_id` is done: its memory metrics (for its record)."""
        if self._profiled is not None and rollout_id >= self._profiled[1]:
            self._stop_profiles()
        if self.memory is None:
            return {}
        if rollout_id + 1 == self.settings.memory_snapshot_num_steps:
            self._dump_cuda(f"after_rollout_{rollout_id}")
        self.memory.watch(self._processes(engines_only=True))  # a restarted engine's new pid
        return self.memory.finish_rollout(rollout_id)

    def close(self) -> None:
        """End a window the run did not reach the end of, and the memory sampling."""
        if self._profiled is not None:
            self._stop_profiles()
        if self._cuda_history:  # a run shorter than --memory-snapshot-num-steps
            self._dump_cuda("at_end")
        if self.memory is not None:
            self.memory.close()

    # -- profiling ------------------------------------------------------------------------------

    def _start_profiles(self, first: int, last: int) -> None:
        targets = self.settings.profiles
        self._profiled = (first, last)
        if "train" in targets and self.trainers is not None:
            self._on_ranks(torch_trace.start_trace)
        rollout_side = [t for t in targets if t != "train"]
        if rollout_side:
            ray.get(
                self.rollout_manager.start_profiling.remote(
                    rollout_side, str(self.profile_dir), self._label
                ),
                timeout=_CALL_TIMEOUT_S,
            )

    def _stop_profiles(self) -> None:
        assert self._profiled is not None
        first, last = self._profiled
        label = self._label
        # Stopped once, whatever happens below: a failure here must not make close() retry it.
        self._profiled, self._profile_done = None, True
        written: list[str] = []
        if "train" in self.settings.profiles and self.trainers is not None:
            written += self._on_ranks(
                torch_trace.stop_trace,
                path=lambda stem: str(self.profile_dir / "train" / f"{stem}.{label}.pt.trace.json"),
            )
        if any(t != "train" for t in self.settings.profiles):
            call = self.rollout_manager.stop_profiling.remote()
            written += ray.get(call, timeout=_CALL_TIMEOUT_S)
        logger.info(
            "profiled rollouts %d..%d (%s): %d trace(s) under %s; open them in "
            "https://ui.perfetto.dev or TensorBoard",
            first, last, ", ".join(self.settings.profiles), len(written), self.profile_dir,
        )  # fmt: skip

    @property
    def _label(self) -> str:
        assert self._profiled is not None
        first, last = self._profiled
        return f"rollouts_{first}-{last}"

    # -- memory ---------------------------------------------------------------------------------

    def _processes(self, *, engines_only: bool = False) -> Processes:
        found: Processes = {}
        if not engines_only:
            found["driver"] = (os.getpid(), ray.get_runtime_context().get_node_id())
            if self.trainers is not None:
                labels = [label for label, _, _ in self._ranks()]
                found.update(zip(labels, self._on_ranks(_pid_and_node), strict=True))
        if self.rollout_manager is not None:
            processes = ray.get(self.rollout_manager.process_ids.remote(), timeout=_CALL_TIMEOUT_S)
            found.update(
                {k: v for k, v in processes.items() if not engines_only or k.startswith("engine_")}
            )
        return found

    def _start_cuda_history(self) -> None:
        if self.trainers is None:
            return
        directory = Path(self.settings.memory_snapshot_dir or ".")
        started = self._on_ranks(
            cuda_memory.start_history,
            oom_path=lambda stem: str(directory / f"cuda_{stem}.oom.pickle"),
        )
        self._cuda_history = all(started)

    def _dump_cuda(self, label: str) -> None:
        if not self._cuda_history:
            return
        directory = Path(self.settings.memory_snapshot_dir or ".")
        paths = self._on_ranks(
            cuda_memory.dump_snapshot,
            path=lambda stem: str(directory / f"cuda_{stem}.{label}.pickle"),
        )
        self._cuda_history = False
        logger.info("CUDA memory snapshots %s (open them in https://pytorch.org/memory_viz)",
                    ", ".join(p for p in paths if p))  # fmt: skip

    # -- helpers --------------------------------------------------------------------------------

    def _ranks(self) -> list[tuple[str, str, Any]]:
        """(process label, file stem, Ray actor) of every train rank: the policy's
        (`train_rank_<r>`, `rank_<r>`), then a critic's of its own (`critic_rank_<r>`)."""
        assert self.trainers is not None
        ranks = [(f"train_rank_{r}", f"rank_{r}", a) for r, a in enumerate(self.trainers.actors)]
        if self.critics is not None:
            critics = enumerate(self.critics.actors)
            ranks += [(f"critic_rank_{r}", f"critic_rank_{r}", a) for r, a in critics]
        return ranks

    def _on_ranks(self, fn: Any, **per_rank: Any) -> list[Any]:
        """`fn(actor, **kwargs)` in every train rank's process (`_ranks`), the kwargs' callables
        given the rank's file stem; the results in that order."""
        calls = [
            actor.__ray_call__.remote(
                fn, **{k: (v(stem) if callable(v) else v) for k, v in per_rank.items()}
            )
            for _, stem, actor in self._ranks()
        ]
        return ray.get(calls, timeout=_CALL_TIMEOUT_S)


def _pid_and_node(_actor: Any) -> tuple[int, str]:
    return os.getpid(), ray.get_runtime_context().get_node_id()
