"""The watchdog of a local Ray instance: a small process that outlives a killed driver and stops
what the driver's Ray left running.

    python -m miles.utils.ray_watchdog SESSION_DIR PID:START [PID:START ...]

The driver that started Ray (`miles.ray.local_ray`) starts this in a session of its own (a signal
to the driver's process group does not reach it), with a pipe on its stdin and Ray's head
processes on the command line. Every half second it notes those processes and everything below
them (workers, Ray's dashboard and runtime-env agents, engine servers). When the pipe closes
without a "release" line, the driver is gone (SIGKILL, a crash): it SIGKILLs every process noted
that still runs, then removes the session directory unless the driver wrote "keep" (a failed
run's logs). Ray's own fate sharing stops only the head processes; its agents, orphaned, would
otherwise run on (one listening on a port). It imports no Ray, so it starts in a blink.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
from pathlib import Path

from miles.utils.process_tree import ProcessKey, descendants, kill_all

_SCAN_S = 0.5


def remove_session_dir(session_dir: str | Path) -> None:
    """Remove a Ray session directory, and `session_latest` where it still names this one."""
    session_dir = Path(session_dir)
    latest = session_dir.parent / "session_latest"
    try:
        if latest.is_symlink() and Path(os.readlink(latest)).name == session_dir.name:
            latest.unlink()
    except OSError:
        pass
    shutil.rmtree(session_dir, ignore_errors=True)


def watch(session_dir: str, roots: list[ProcessKey], commands: int) -> None:
    """Note the processes below `roots` until the driver's pipe (fd `commands`) says or ends."""
    known: set[ProcessKey] = set()
    keep = False
    buffered = b""
    while True:
        # Noted processes stay noted: once a parent dies, its orphans no longer descend from
        # the roots, but are still the run's (and their own children too).
        known = descendants([*roots, *known])
        ready, _, _ = select.select([commands], [], [], _SCAN_S)
        if not ready:
            continue
        chunk = os.read(commands, 4096)
        buffered += chunk
        lines = buffered.decode(errors="replace").split("\n")
        if "release" in lines:
            return  # the driver stopped its Ray itself
        keep = keep or "keep" in lines
        if not chunk:  # EOF: the driver is gone without a word
            kill_all(known)
            if not keep:
                remove_session_dir(session_dir)
            return


def main(argv: list[str]) -> int:
    # The driver's death is this process's cue; a SIGTERM or Ctrl-C sent to everything (Slurm's
    # scancel signals every process of the job) must not stop it before it has done its work.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    session_dir, *pids = argv
    roots = [(int(pid), int(start)) for pid, start in (item.split(":") for item in pids)]
    watch(session_dir, roots, sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
