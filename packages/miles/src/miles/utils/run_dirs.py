"""What a run finds on disk before it starts, checked before Ray starts anything.

Two promises (architecture.md: "Checkpoints"):
- a run never starts fresh by accident: a `--load` directory other than `--save` must hold a
  complete checkpoint. Only a `--save` directory without one yet starts fresh, and that is logged;
- a run never overwrites another run's records: a fresh run refuses an `--output-dir` whose
  metrics.jsonl holds rollouts unless `--overwrite-output-dir` is given, and then keeps the old file
  beside the new one. A resumed run drops only the rollouts it runs again (`JsonlWriter`), into a
  file of their own.
"""

from __future__ import annotations

import logging
from pathlib import Path

from miles.utils.checkpoint_layout import POINTER_FILE, latest_rollout_id
from miles.utils.tracking import METRICS_FILE, read_metrics, unused_sibling

logger = logging.getLogger(__name__)


class RunDirectoryError(ValueError):
    """A directory named by the config cannot be used as asked; the message says how to fix it."""


def checkpoint_to_resume(load: str | None, save: str | None) -> int | None:
    """The rollout id of the checkpoint `--load` resumes from, or None for a fresh start."""
    if load is None:
        return None
    directory = Path(load)
    latest = latest_rollout_id(directory) if directory.is_dir() else None
    if latest is not None:
        return latest
    if save is not None and directory == Path(save):
        logger.info("starting fresh: --save %s holds no checkpoint yet", load)
        return None
    fix = "name the --save directory of the run to resume, or drop --load to start fresh"
    if not directory.exists():
        raise RunDirectoryError(f"--load {load} does not exist; {fix}")
    raise RunDirectoryError(
        f"--load {load} holds no checkpoint (no {POINTER_FILE} file naming a complete iter_* "
        f"directory); {fix}"
    )


def claim_output_dir(output_dir: str, *, resuming: bool, overwrite: bool) -> None:
    """Refuse (or, with `overwrite`, set aside) another run's metrics in a fresh run's directory.

    A resumed run continues its own records, so nothing is refused then."""
    metrics = Path(output_dir) / METRICS_FILE
    if resuming or not metrics.is_file():
        return
    records = read_metrics(metrics)
    if not records:
        return  # an empty file holds nothing to lose
    rollouts = [r["rollout_id"] for r in records if "rollout_id" in r]
    span = f"rollouts {min(rollouts)}..{max(rollouts)}" if rollouts else "no rollout ids"
    if not overwrite:
        raise RunDirectoryError(
            f"--output-dir {output_dir} holds the metrics of another run ({len(records)} "
            f"records, {span}) and this run starts fresh; choose another --output-dir, resume "
            "that run with --load <its --save directory>, or pass --overwrite-output-dir to "
            "start over (the old metrics are kept beside the new ones)"
        )
    kept = unused_sibling(metrics, "replaced")
    metrics.rename(kept)
    logger.warning("--overwrite-output-dir: the earlier run's metrics are now %s", kept)
