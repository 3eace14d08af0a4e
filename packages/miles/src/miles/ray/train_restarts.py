"""Trainer fault tolerance's bookkeeping (architecture.md: "Trainer fault tolerance"): which
rollouts a restarted train group replays, how many restarts are left, and what they cost.

When a train rank dies or hangs, `Run` starts the train group again. The new group loads the run's
last checkpoint and trains again, in order, on the kept train data of every rollout trained since
(`miles.ray.kept_train_data`), so it returns to exactly the state the old group had; the engines
keep running and must still report the weight version the run pushed last. A failure that comes
back after every restart (a rank that fails deterministically) stops the run after
--max-train-restarts, naming the last failure.
"""

from __future__ import annotations

import logging

from miles.ray.train_group import TrainRankError

logger = logging.getLogger(__name__)


class TrainRestartsExhaustedError(RuntimeError):
    """Train ranks failed again after --max-train-restarts restarts of their group."""


class TrainRestarts:
    """The restarts of one run's train group."""

    def __init__(self, max_restarts: int, *, resume_at: int) -> None:
        """`resume_at`: the rollout a group started now resumes at (after the checkpoint the
        run started from)."""
        self.max_restarts = max_restarts
        self.resume_at = resume_at
        self.trained: list[int] = []  # rollouts trained since that checkpoint, in order
        self.restarts = 0
        self.replayed = 0
        self.seconds_lost = 0.0

    def trained_rollout(self, rollout_id: int) -> None:
        self.trained.append(rollout_id)

    def checkpointed(self, rollout_id: int) -> None:
        """Rollout `rollout_id`'s checkpoint is complete: a restart returns to it."""
        self.resume_at = rollout_id + 1
        self.trained = [r for r in self.trained if r > rollout_id]

    def count(self, cause: TrainRankError) -> None:
        """One more failure of the group; raises once it is past the restarts allowed."""
        self.restarts += 1
        if self.restarts > self.max_restarts:
            raise TrainRestartsExhaustedError(
                f"train ranks failed {self.restarts} times, and --max-train-restarts is "
                f"{self.max_restarts}; the last failure: {cause}. A rank that fails again after "
                "every restart fails deterministically (its data, settings or device): fix that, "
                "then run the same command to resume from the last checkpoint"
            ) from cause
        logger.warning(
            "%s; restarting the train group (restart %d of %d): it resumes at rollout %d and "
            "replays rollouts %s", cause, self.restarts, self.max_restarts, self.resume_at,
            self.trained or "none",
        )  # fmt: skip

    def metrics(self) -> dict[str, float]:
        """Counts over the run so far, in every rollout's record."""
        return {
            "train/restarts": float(self.restarts),
            "train/replayed_rollouts": float(self.replayed),
            "train/seconds_lost": self.seconds_lost,
        }
