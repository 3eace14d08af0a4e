"""What a run finds on disk before it starts, checked before Ray starts anything.

Three promises (architecture.md: "Checkpoints"):
- a run never starts fresh by accident: a `--load` directory other than `--save` must hold a
  complete checkpoint. Only a `--save` directory without one yet starts fresh, and that is logged;
- a run never loads a damaged checkpoint: the latest is checked against its manifest. Resuming
  its own `--save` (`--load` = `--save`), a run falls back to the newest good checkpoint with a
  warning and names it the latest; an explicit `--load` of a damaged one is an error;
- a run never overwrites another run's records: a fresh run refuses an `--output-dir` whose
  metrics.jsonl holds rollouts unless `--overwrite-output-dir` is given, and then keeps the old file
  beside the new one. A resumed run drops only the rollouts it runs again (`JsonlWriter`), into a
  file of their own.
"""

from __future__ import annotations

import logging
from pathlib import Path

from miles.utils.checkpoint_layout import (
    POINTER_FILE,
    atomic_write_text,
    checkpoint_ids,
    checkpoint_problems,
    has_manifest,
    iteration_dir,
    latest_rollout_id,
)
from miles.utils.tracking import METRICS_FILE, read_metrics, unused_sibling

logger = logging.getLogger(__name__)


class RunDirectoryError(ValueError):
    """A directory named by the config cannot be used as asked; the message says how to fix it."""


def checkpoint_to_resume(
    load: str | None, save: str | None, *, flag: str = "--load", at_most: int | None = None
) -> int | None:
    """The rollout id of the checkpoint `--load` resumes from, or None for a fresh start.

    The latest checkpoint is verified first (`checkpoint_problems`); see the module docstring
    for what a damaged one leads to. `flag` names the directory in messages (`--critic-load`);
    `at_most` (a run's own directory only) resumes no later than that rollout: a critic beside a
    policy that fell back."""
    if load is None:
        return None
    directory = Path(load)
    latest = latest_rollout_id(directory) if directory.is_dir() else None
    if latest is not None:
        own = save is not None and directory.resolve() == Path(save).resolve()
        return _newest_good(directory, latest, flag=flag, own=own, at_most=at_most)
    if save is not None and directory == Path(save):
        logger.info("starting fresh: --save %s holds no checkpoint yet", load)
        return None
    fix = "name the --save directory of the run to resume, or drop --load to start fresh"
    if not directory.exists():
        raise RunDirectoryError(f"{flag} {load} does not exist; {fix}")
    raise RunDirectoryError(
        f"{flag} {load} holds no checkpoint (no {POINTER_FILE} file naming a complete iter_* "
        f"directory); {fix}"
    )


def _newest_good(directory: Path, latest: int, *, flag: str, own: bool, at_most: int | None) -> int:
    """`latest` if its checkpoint is whole; else, in the run's `own` directory, the newest
    whole one before it, which the pointer then names (damaged ones stay on disk to inspect)."""
    problems = checkpoint_problems(directory, latest)
    if not problems and (not own or at_most is None or latest <= at_most):
        _warn_if_unverified(directory, latest)
        return latest
    if not own:
        raise RunDirectoryError(
            f"{flag} {directory}: checkpoint {iteration_dir(directory, latest)} is damaged: "
            f"{'; '.join(problems)}; restore its files, or resume from an earlier checkpoint by "
            f"writing its rollout id into {directory / POINTER_FILE}"
        )
    skipped = []
    if problems:
        skipped.append(f"{iteration_dir(directory, latest)} is damaged: {'; '.join(problems)}")
    for candidate in checkpoint_ids(directory):
        if candidate >= latest or (at_most is not None and candidate > at_most):
            continue
        if found := checkpoint_problems(directory, candidate):
            skipped.append(f"{iteration_dir(directory, candidate)} is damaged: {'; '.join(found)}")
            continue
        logger.warning(
            "%s: resuming from the newest good checkpoint, %s; %s",
            flag, iteration_dir(directory, candidate),
            " | ".join(skipped) or f"the others are newer than rollout {at_most}",
        )  # fmt: skip
        _warn_if_unverified(directory, candidate)
        # Not commit_checkpoint: that would write the manifest anew from the files as they are.
        atomic_write_text(directory / POINTER_FILE, f"{candidate}\n")
        return candidate
    raise RunDirectoryError(
        f"{flag} {directory} holds no usable checkpoint: {' | '.join(skipped)}; restore the "
        "files, or move the directory away to start fresh"
    )


def _warn_if_unverified(directory: Path, rollout_id: int) -> None:
    if not has_manifest(directory, rollout_id):
        logger.warning(
            "checkpoint %s has no manifest (saved by a miles before checkpoints carried one): "
            "loading it without checking its files", iteration_dir(directory, rollout_id),
        )  # fmt: skip


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
