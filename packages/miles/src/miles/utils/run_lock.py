"""A run owns its directories: `--output-dir` and `--save` hold a lock file while it runs.

Two runs started on one directory would otherwise mix silently: both start fresh, one resumes
from the other's checkpoint, one metrics.jsonl gets both runs' rollouts. `RunLock` takes
`<dir>/.miles.lock` (pid, host, start time, created exclusively) before the run writes anything,
refuses a directory another live run holds in one line naming it, and takes over a stale lock
with a warning.

Stale means: its process is gone (same host: the pid is not alive), or, for a lock of another
host, its heartbeat stopped: the owner touches the file every `HEARTBEAT_S`, and a lock not
touched for `STALE_AFTER_S` is taken to be dead. On a filesystem shared between nodes this needs
clocks within `STALE_AFTER_S - HEARTBEAT_S` of each other and a filesystem whose exclusive create
is atomic (local disks, NFSv3+, Lustre, GPFS); docs/reliability.md, "A run owns its directories".
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from miles.utils.run_dirs import RunDirectoryError

logger = logging.getLogger(__name__)

LOCK_FILE = ".miles.lock"
HEARTBEAT_S = 10.0
"""How often the owner touches its lock files."""
STALE_AFTER_S = 60.0
"""A lock of another host not touched for this long belongs to a run that is gone."""


class DirectoryInUseError(RunDirectoryError):
    """Another live run holds a directory this run was given (`miles train` says so in one line,
    and writes nothing into that directory)."""


@dataclass(frozen=True)
class LockOwner:
    pid: int
    host: str
    started_at: float
    token: str
    """Tells this lock's owner from a later one in the same process."""

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_at))
        return f"pid {self.pid} on {self.host}, started {started}"


class RunLock:
    """The lock files of one run's directories; `release` (or the context's exit) removes them."""

    def __init__(self, directories: dict[str, str | None]) -> None:
        """`directories`: {flag: path} (e.g. {"--output-dir": ..., "--save": ...}); None
        entries and repeats are skipped. Raises DirectoryInUseError for a held one."""
        self.owner = LockOwner(os.getpid(), socket.gethostname(), time.time(), uuid.uuid4().hex)
        self.paths: list[Path] = []
        self._stop = threading.Event()
        seen: set[Path] = set()
        try:
            for flag, directory in directories.items():
                if directory is None or Path(directory).resolve() in seen:
                    continue
                seen.add(Path(directory).resolve())
                self.paths.append(_take(flag, Path(directory), self.owner))
        except BaseException:
            self.release()
            raise
        self._heartbeat = threading.Thread(target=self._beat, name="miles-run-lock", daemon=True)
        self._heartbeat.start()

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> None:
        """Remove the lock files this run still owns (never a later owner's)."""
        self._stop.set()
        for path in self.paths:
            if _read_owner(path) == self.owner:
                path.unlink(missing_ok=True)
        self.paths = []

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            for path in list(self.paths):
                try:
                    os.utime(path)
                except OSError as err:  # removed by hand, say: the next start may not see us
                    logger.warning("cannot touch the run lock %s: %s", path, err)


def _take(flag: str, directory: Path, owner: LockOwner) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    for _ in range(3):  # a stale lock removed, or a racing run: look again
        if _create(path, owner):
            return path
        holder = _read_owner(path)
        if holder is None:  # being written, or unreadable: give the writer a moment
            time.sleep(0.2)
            holder = _read_owner(path)
        why = _stale(path, holder)
        if why is None:
            assert holder is not None
            raise DirectoryInUseError(
                f"{flag} {directory} is in use by another run ({holder.describe()}); wait for "
                f"it to end, stop it, or give this run another {flag}"
            )
        logger.warning(
            "%s %s: taking over the lock of a run that is gone (%s: %s)",
            flag, directory, holder.describe() if holder else "unreadable lock", why,
        )  # fmt: skip
        path.unlink(missing_ok=True)
    raise DirectoryInUseError(
        f"{flag} {directory}: could not take {path}, another run takes it at the same time"
    )


def _create(path: Path, owner: LockOwner) -> bool:
    """Write the lock if none exists (atomically: exclusive create); whether it was written."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(owner.__dict__, f)
        f.flush()
        os.fsync(f.fileno())
    return True


def _read_owner(path: Path) -> LockOwner | None:
    try:
        return LockOwner(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _stale(path: Path, holder: LockOwner | None) -> str | None:
    """Why the lock at `path` belongs to no live run, or None if it may."""
    try:
        idle = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return "removed meanwhile"
    if holder is None:
        return f"unreadable for {idle:.0f} s" if idle > STALE_AFTER_S else None
    if holder.host == socket.gethostname():
        if holder.pid == os.getpid():
            return None  # this process's own run: one run per directory here too
        return None if _alive(holder.pid) else f"pid {holder.pid} is not running"
    if idle > STALE_AFTER_S:
        return f"no heartbeat for {idle:.0f} s"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True
