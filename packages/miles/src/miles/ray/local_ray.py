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
- **The end.** However Ray stops the instance (`ray.shutdown()`, its exit hook,
  `stop_local_ray`), everything stops at once and the session directory is removed, unless
  `stop_local_ray(keep_session=True)` (a failed run's logs are there).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

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
    keep_session: bool = False

    def stop(self, kill_head_processes: Callable[..., None]) -> None:
        """Stop every process of the instance and remove its session directory (unless
        `keep_session`); the driver has left the cluster."""
        processes = descendants(self.roots)
        # Ray stops its head processes with SIGTERM, which they block (module docstring), and
        # waits a second for each before it SIGKILLs it. The run's actors are stopped by now, and
        # this process has left the cluster: SIGKILL at once, then what the raylet leaves
        # behind (its agents, its workers).
        kill_head_processes(check_alive=False, allow_graceful=False, wait=True)
        left = kill_all(descendants([*self.roots, *processes]) | processes)
        if left:
            logger.warning("processes %s of the local Ray instance survived SIGKILL",
                           sorted(pid for pid, _ in left))  # fmt: skip
        if self.keep_session:
            logger.info("kept the Ray session directory %s (its logs)", self.session_dir)
            _tell_watchdog(self.watchdog, "keep")
        else:
            remove_session_dir(self.session_dir)
        _tell_watchdog(self.watchdog, "release")


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
        # The handlers first: a signal that came meanwhile is delivered as soon as the mask is
        # restored, and must find this process's handler, not the one Ray's start installed.
        if on_main:
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def start_local_ray(**init_kwargs: Any) -> None:
    """`ray.init(address="local", **init_kwargs)`, signal-proof and watched (module docstring).
    However Ray is stopped afterwards (`ray.shutdown()`, its exit hook, `stop_local_ray`), it
    stops at once, entirely, and removes its session directory."""
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
    local = _LocalRay(session_dir, roots, watchdog)
    # Every way Ray stops its local instance ends in this node's `kill_all_processes`; this one
    # instance's method is replaced by `_LocalRay.stop` (Ray's version is pinned in uv.lock).
    kill_head_processes = node.kill_all_processes
    stopped = False

    def kill_all_processes(*_args: Any, **_kwargs: Any) -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            local.stop(kill_head_processes)

    node.kill_all_processes = kill_all_processes
    _local = local
    logger.info("local Ray session %s (watchdog pid %d)", session_dir, watchdog.pid)


def local_session_dir() -> str | None:
    """The session directory of the local Ray instance this process started, if any."""
    return _local.session_dir if _local is not None else None


def stop_local_ray(*, keep_session: bool = False) -> None:
    """Stop Ray: a local instance this process started goes entirely (its agents included) and
    its session directory is removed unless `keep_session`; a joined cluster is only left."""
    global _local
    if _local is not None:
        _local.keep_session = keep_session
        _local = None
    if ray.is_initialized():
        ray.shutdown()


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
