"""A local Ray instance that the driver owns: started immune to the signals meant for the driver,
watched for the driver's death, and stopped, with its session directory, when the run ends.

- **Signals.** Ray starts its head processes (GCS, raylet, agents) in the driver's process group,
  and its workers inherit the raylet's signal mask. A SIGTERM or SIGINT sent to the group (Slurm,
  a terminal's Ctrl-C, `kill -- -PGID`) would kill them under the driver, which then aborts with
  a crash dump instead of stopping gracefully. They are started with both signals blocked (a
  blocked mask survives exec), so only the driver sees them and decides; Ray's start also
  replaces the driver's own SIGTERM handler with its crash handler, so the driver's handlers are
  put back after it.
- **The driver's death.** `miles.utils.ray_watchdog`, a process in a session of its own, stops
  every process of the instance when the driver dies without stopping it (SIGKILL).
- **The end.** `stop_local_ray` stops everything quickly and removes the session directory,
  unless asked to keep it (a failed run's logs are there).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import ray
from miles.utils.process_tree import ProcessKey, descendants, key_of, kill_all
from miles.utils.ray_watchdog import remove_session_dir

logger = logging.getLogger(__name__)

_HELD = {signal.SIGTERM, signal.SIGINT}


@dataclass
class _LocalRay:
    session_dir: str
    roots: list[ProcessKey]
    watchdog: subprocess.Popen


_local: _LocalRay | None = None


@contextlib.contextmanager
def signals_held_from_children() -> Iterator[None]:
    """Block SIGTERM and SIGINT in this thread while Ray starts its processes (they inherit the
    mask), then restore the mask and this process's Python handlers."""
    handlers = {sig: signal.getsignal(sig) for sig in _HELD}
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        if on_main:
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)


def start_local_ray(**init_kwargs) -> None:
    """`ray.init(address="local", **init_kwargs)`, signal-proof and watched (module docstring)."""
    global _local
    with signals_held_from_children():
        ray.init(address="local", **init_kwargs)
    node = ray._private.worker._global_node
    roots = [
        key
        for infos in node.all_processes.values()
        for info in infos
        if (key := key_of(info.process.pid)) is not None
    ]
    session_dir = node.get_session_dir_path()
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "miles.utils.ray_watchdog", session_dir,
         *(f"{pid}:{start}" for pid, start in roots)],
        stdin=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    _local = _LocalRay(session_dir, roots, watchdog)
    logger.info("local Ray session %s (watchdog pid %d)", session_dir, watchdog.pid)


def local_session_dir() -> str | None:
    """The session directory of the local Ray instance this process started, if any."""
    return _local.session_dir if _local is not None else None


def stop_local_ray(*, keep_session: bool = False) -> None:
    """Stop Ray: a local instance this process started goes entirely (its agents included) and
    its session directory is removed unless `keep_session`; a joined cluster is only left."""
    global _local
    local, _local = _local, None
    if local is None:
        if ray.is_initialized():
            ray.shutdown()
        return
    processes = descendants(local.roots)
    # Ray stops its head processes with SIGTERM, which they block (module docstring), and waits
    # a second for each before it SIGKILLs it. The run's actors are already stopped: once this
    # process has left the cluster, SIGKILL the lot at once (the raylet and the GCS only then,
    # never while the driver is connected: it would exit with them).
    killer = threading.Thread(target=_kill_once_disconnected, args=(processes,), daemon=True)
    killer.start()
    ray.shutdown()
    killer.join(timeout=10)
    left = kill_all(descendants([*local.roots, *processes]) | processes)
    if left:
        logger.warning("processes %s of the local Ray instance survived SIGKILL",
                       sorted(pid for pid, _ in left))  # fmt: skip
    if keep_session:
        logger.info("kept the Ray session directory %s (its logs)", local.session_dir)
        _tell_watchdog(local.watchdog, "keep")
    else:
        remove_session_dir(local.session_dir)
    _tell_watchdog(local.watchdog, "release")


def _kill_once_disconnected(processes: set[ProcessKey]) -> None:
    deadline = time.monotonic() + 10
    while ray.is_initialized() and time.monotonic() < deadline:
        time.sleep(0.01)
    kill_all(processes, wait_s=0)


def _tell_watchdog(watchdog: subprocess.Popen, word: str) -> None:
    assert watchdog.stdin is not None
    try:
        watchdog.stdin.write(f"{word}\n".encode())
        watchdog.stdin.flush()
        if word == "release":
            watchdog.stdin.close()
            watchdog.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("the Ray watchdog (pid %d): %s", watchdog.pid, exc)
