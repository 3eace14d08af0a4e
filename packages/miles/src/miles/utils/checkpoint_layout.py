"""Where a run's checkpoints live, shared by core and every backend.

(architecture.md: "Contracts / Checkpoints")

`<save>/iter_<N:07d>/` holds the backend's state of rollout N, `<save>/rollout/iter_<N:07d>.json`
the rollout side's (data-source position, partial-rollout buffer), and
`<save>/latest_checkpointed_iteration.txt` names the newest complete N. The pointer is written
last, after both parts, so a crash mid-save leaves the previous checkpoint the latest. In a run,
"last" is also after the rollout's metrics record is logged (`Run.finish_rollout`): a run killed
between the two resumes from the previous checkpoint and logs the rollout again, so no record of
a checkpointed rollout is ever missing.

Each committed checkpoint carries `iter_<N:07d>/manifest.json`, the size and SHA-256 of every file
of both parts, written just before the pointer: a directory without one is a save that did not
finish (or an older miles's checkpoint), and `checkpoint_problems` finds a truncated, missing or
altered file before anything loads it. SHA-256 rather than a faster CRC: `sha256sum` checks it by
hand, and with SHA extensions it hashes ~1.7 GB/s per core, files in parallel.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

POINTER_FILE = "latest_checkpointed_iteration.txt"
META_FILE = "meta.json"
"""Each backend's record of an `iter_*` directory (its rollout id, counters, extra state): the
file a save writes last, and the one a checkpoint without a manifest is checked by."""
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
_CHUNK_BYTES = 8 * 2**20


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
    """Name rollout `rollout_id`'s checkpoint the latest: call once all of its parts are written.

    Its manifest is written first, then the pointer, so a checkpoint the pointer names is whole."""
    write_manifest(save_dir, rollout_id)
    atomic_write_text(Path(save_dir) / POINTER_FILE, f"{rollout_id}\n")


def checkpoint_ids(save_dir: str | os.PathLike) -> list[int]:
    """The rollout ids of the `iter_*` directories in `save_dir`, newest first (complete or not)."""
    ids = []
    for path in Path(save_dir).glob("iter_*"):
        suffix = path.name.removeprefix("iter_")
        if path.is_dir() and suffix.isdigit():
            ids.append(int(suffix))
    return sorted(ids, reverse=True)


def _checkpoint_files(save_dir: Path, rollout_id: int) -> list[Path]:
    """Every file of checkpoint `rollout_id`: the backend's directory and the rollout state."""
    directory = iteration_dir(save_dir, rollout_id)
    files = [p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE]
    rollout_state = rollout_state_path(save_dir, rollout_id)
    if rollout_state.is_file():
        files.append(rollout_state)
    return sorted(files)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)  # releases the GIL: files hash in parallel threads
    return digest.hexdigest()


def _hash_all(paths: list[Path]) -> list[str]:
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(_sha256, paths))


def write_manifest(save_dir: str | os.PathLike, rollout_id: int) -> Path:
    """Record the size and SHA-256 of every file of checkpoint `rollout_id` in its manifest
    (paths relative to `save_dir`); the last file the checkpoint gets before the pointer."""
    save_dir = Path(save_dir)
    files = _checkpoint_files(save_dir, rollout_id)
    entries = {
        str(path.relative_to(save_dir)): {"bytes": path.stat().st_size, "sha256": digest}
        for path, digest in zip(files, _hash_all(files), strict=True)
    }
    manifest = {"format": MANIFEST_FORMAT, "rollout_id": rollout_id, "files": entries}
    path = iteration_dir(save_dir, rollout_id) / MANIFEST_FILE
    atomic_write_text(path, json.dumps(manifest, indent=1))
    return path


def has_manifest(save_dir: str | os.PathLike, rollout_id: int) -> bool:
    """Whether checkpoint `rollout_id` was committed with a manifest (miles wrote none before)."""
    return (iteration_dir(save_dir, rollout_id) / MANIFEST_FILE).is_file()


def checkpoint_problems(save_dir: str | os.PathLike, rollout_id: int) -> list[str]:
    """What is wrong with checkpoint `rollout_id` (empty: nothing), each naming the file.

    With a manifest every listed file must exist with its size and checksum; without one (an
    older miles's checkpoint) only its meta.json is checked, which must be readable JSON."""
    save_dir = Path(save_dir)
    directory = iteration_dir(save_dir, rollout_id)
    if not directory.is_dir():
        return [f"{directory} does not exist"]
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        return _meta_problems(directory)
    try:
        manifest = json.loads(manifest_path.read_text())
        entries = manifest["files"]
        expected = {name: (int(e["bytes"]), str(e["sha256"])) for name, e in entries.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return [f"{manifest_path} is unreadable ({type(err).__name__}: {err})"]
    problems, to_hash = [], []
    for name, (size, _) in sorted(expected.items()):
        path = save_dir / name
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif (actual := path.stat().st_size) != size:
            problems.append(
                f"{path} has {actual} bytes, {size} when saved (truncated or rewritten)"
            )
        else:
            to_hash.append(name)
    digests = _hash_all([save_dir / name for name in to_hash])
    for name, digest in zip(to_hash, digests, strict=True):
        if digest != expected[name][1]:
            problems.append(
                f"{save_dir / name} does not match its SHA-256 (its bytes changed since the save)"
            )
    return problems


def read_meta(directory: str | os.PathLike, fix: str) -> dict:
    """The checkpoint `directory`'s META_FILE; ValueError naming the file when it is not valid
    JSON (an empty or cut-off file), ending with `fix`, what the reader can do about it."""
    directory = Path(directory)
    try:
        return json.loads((directory / META_FILE).read_text())
    except ValueError as err:  # name the file, not only the JSON position
        raise ValueError(
            f"checkpoint {directory} is damaged: {directory / META_FILE} is not valid JSON "
            f"({err}); {fix}"
        ) from None


def _meta_problems(directory: Path) -> list[str]:
    meta = directory / META_FILE
    if not meta.is_file():
        return [f"{meta} is missing (the save did not finish)"]
    try:
        json.loads(meta.read_text())
    except ValueError as err:
        return [f"{meta} is not valid JSON ({err})"]
    return []


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
