"""Where a run's checkpoints live, shared by core and every backend.

(architecture.md: "Contracts / Checkpoints")

`<save>/iter_<N:07d>/` holds the backend's state of rollout N, `<save>/rollout/iter_<N:07d>.json`
the rollout side's (data-source position, partial-rollout buffer), and
`<save>/latest_checkpointed_iteration.txt` names the newest complete N. The pointer is written
last, after both parts, so a crash mid-save leaves the previous checkpoint the latest. In a run,
"last" is also after the rollout's metrics record is logged (`Run.finish_rollout`): a run killed
between the two resumes from the previous checkpoint and logs the rollout again, so no record of
a checkpointed rollout is ever missing.
"""

from __future__ import annotations

import os
from pathlib import Path

POINTER_FILE = "latest_checkpointed_iteration.txt"


def iteration_dir(save_dir: str | os.PathLike, rollout_id: int) -> Path:
    """`<save_dir>/iter_<rollout_id:07d>`, the backend's directory of one checkpoint."""
    return Path(save_dir) / f"iter_{rollout_id:07d}"


def rollout_state_path(save_dir: str | os.PathLike, rollout_id: int) -> Path:
    """The rollout side's state of one checkpoint (written before the backend's part)."""
    return Path(save_dir) / "rollout" / f"iter_{rollout_id:07d}.json"


def latest_rollout_id(load_dir: str | os.PathLike) -> int | None:
    """The rollout id the pointer file names, or None when there is no pointer."""
    pointer = Path(load_dir) / POINTER_FILE
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"{pointer} holds {text!r}, not a rollout id; write the number of the latest complete "
            "iter_* directory into it, or delete it to start fresh"
        ) from None


def latest_checkpoint_name(load_dir: str | os.PathLike) -> str | None:
    """The latest complete checkpoint's directory name (`iter_0000007`), or None."""
    latest = latest_rollout_id(load_dir)
    return None if latest is None else iteration_dir(load_dir, latest).name


def commit_checkpoint(save_dir: str | os.PathLike, rollout_id: int) -> None:
    """Name rollout `rollout_id`'s checkpoint the latest: call once all of its parts are written."""
    atomic_write_text(Path(save_dir) / POINTER_FILE, f"{rollout_id}\n")


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write via a temporary file and rename, so readers see the old content or the new, whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
