"""Where a run's rollouts come from: the rollout manager's engines, or rollouts saved earlier.

`Run` picks one source when it starts (`--debug-train-only` replays saved rollouts) and the loop
never asks again: both sources start a rollout, wait for it, and hand back the same `Rollout`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import ray

if TYPE_CHECKING:
    from miles.backends.training_utils.batching.rollout_data import RolloutBatch


@dataclass(frozen=True)
class Rollout:
    """One rollout's train data and what its generation measured."""

    rollout_id: int
    data: list[Any]
    """One Ray object reference per data-parallel replica: replica r trains on `data[r]`."""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PendingRollout:
    """A rollout being generated (returned by `start`, redeemed by `wait`)."""

    rollout_id: int
    call: Any
    """The rollout manager's generate call (None for a replayed rollout)."""
    started_at: float


class RolloutSource(Protocol):
    def start(self, rollout_id: int) -> PendingRollout: ...

    def wait(self, pending: PendingRollout) -> Rollout: ...

    def wait_done(self, pending: PendingRollout) -> None:
        """Block until the generation has finished (no result fetched)."""
        ...


class EngineRollouts:
    """Rollouts the rollout manager generates on the engines."""

    def __init__(self, rollout_manager: Any, *, await_call: Callable[[Any], Any] = ray.get) -> None:
        """`await_call(ref)` waits for a manager call's result (`Run` restores restarted
        engines meanwhile)."""
        self.rollout_manager = rollout_manager
        self.await_call = await_call

    def start(self, rollout_id: int) -> PendingRollout:
        call = self.rollout_manager.generate.remote(rollout_id)
        return PendingRollout(rollout_id, call, time.perf_counter())

    def wait(self, pending: PendingRollout) -> Rollout:
        result = self.await_call(pending.call)
        metrics = {**result["metrics"], "time/generate_s": time.perf_counter() - pending.started_at}
        return Rollout(pending.rollout_id, result["data"], metrics)

    def wait_done(self, pending: PendingRollout) -> None:
        self.await_call(pending.call)

    def take(self, rollout_id: int) -> Rollout:
        """Rollout `rollout_id` from the fully-async buffer; `time/generate_s` is how long the
        trainer waited for it."""
        start = time.perf_counter()
        result = self.await_call(self.rollout_manager.take_rollout.remote(rollout_id))
        metrics = {**result["metrics"], "time/generate_s": time.perf_counter() - start}
        return Rollout(rollout_id, result["data"], metrics)


class ReplayedRollouts:
    """Rollouts saved by an earlier run with --save-debug-rollout-data, one file per rollout."""

    def __init__(self, pattern: str, *, dp_size: int) -> None:
        self.pattern = pattern
        self.dp_size = dp_size

    def start(self, rollout_id: int) -> PendingRollout:
        return PendingRollout(rollout_id, None, time.perf_counter())

    def wait(self, pending: PendingRollout) -> Rollout:
        path = Path(self.pattern.format(rollout_id=pending.rollout_id))
        if not path.is_file():
            raise FileNotFoundError(
                f"--debug-train-only: no saved rollout {pending.rollout_id} at {path} (from "
                f"--load-debug-rollout-data {self.pattern}); save rollouts first with "
                "--save-debug-rollout-data"
            )
        shards = load_saved_shards(path)
        if len(shards) != self.dp_size:
            raise ValueError(
                f"{path} holds {len(shards)} data-parallel shards but this run trains "
                f"{self.dp_size} replicas; replay with the train layout of the run that saved it"
            )
        data = [ray.put(shard) for shard in shards]
        return Rollout(pending.rollout_id, data, {})

    def wait_done(self, pending: PendingRollout) -> None:
        return None


# Columns renamed since --save-debug-rollout-data first wrote files, old name -> name: files saved
# before the rename still replay. The one place that knows the old names.
_RENAMED_COLUMNS = {"log_probs": "old_log_probs", "loss_masks": "loss_mask"}


def load_saved_shards(path: Path) -> list[RolloutBatch]:
    """The data-parallel shards `save_rollout` wrote to `path`, under today's column names (files
    from earlier versions call the loss mask `loss_masks` and the old policy's log-probs
    `log_probs`)."""
    import torch  # saved rollouts are torch files; only a replaying driver imports torch

    shards = torch.load(path, weights_only=False)["shards"]
    return [
        {_RENAMED_COLUMNS.get(key, key): column for key, column in shard.items()}
        for shard in shards
    ]


def save_rollout(pattern: str, rollout: Rollout) -> None:
    """Write `rollout`'s shards where `ReplayedRollouts(pattern)` finds them."""
    path = Path(pattern.format(rollout_id=rollout.rollout_id))
    path.parent.mkdir(parents=True, exist_ok=True)
    import torch  # only a driver that saves its rollouts imports torch

    torch.save({"rollout_id": rollout.rollout_id, "shards": ray.get(list(rollout.data))}, path)
