"""The local Ray instance's watchdog (`miles.utils.ray_watchdog`) with real processes: when the
driver's pipe closes without a word, it kills the watched tree (orphans included) and removes the
session directory; "keep" keeps the directory, "release" leaves everything alone."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.utils.process_tree import descendants, is_alive, key_of, kill_all

# A parent that starts a child in a session of its own (as an engine server is), then exits,
# orphaning it: the watchdog must have noted the child while the parent lived.
_TREE = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
time.sleep(float(sys.argv[1]))
"""


def _watched_tree(tmp_path: Path, parent_lives_s: float):
    session = tmp_path / "session_test"
    (session / "logs").mkdir(parents=True)
    root = subprocess.Popen([sys.executable, "-c", _TREE, str(parent_lives_s)])
    deadline = time.monotonic() + 30
    while len(descendants([key_of(root.pid)])) < 2:  # the child has started
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pid, start = key_of(root.pid)
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "miles.utils.ray_watchdog", str(session), f"{pid}:{start}"],
        stdin=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    return session, root, watchdog


@pytest.mark.parametrize("word", [None, "keep"])
def test_a_vanished_driver_leaves_no_process_and_no_session_dir(tmp_path, word):
    session, root, watchdog = _watched_tree(tmp_path, parent_lives_s=1.0)
    tree = descendants([key_of(root.pid)])
    try:
        time.sleep(1.5)  # the parent has exited: its child lives on, orphaned
        root.wait()
        assert any(is_alive(key) for key in tree)
        if word:
            watchdog.stdin.write(f"{word}\n".encode())
            watchdog.stdin.flush()
        watchdog.stdin.close()  # what the driver's death does to the pipe
        assert watchdog.wait(timeout=10) == 0
        assert not any(is_alive(key) for key in tree)
        assert session.exists() == (word == "keep")
    finally:
        kill_all(tree)
        watchdog.kill()


def test_a_released_watchdog_touches_nothing(tmp_path):
    session, root, watchdog = _watched_tree(tmp_path, parent_lives_s=30.0)
    tree = descendants([key_of(root.pid)])
    try:
        watchdog.stdin.write(b"release\n")
        watchdog.stdin.close()
        assert watchdog.wait(timeout=10) == 0
        assert all(is_alive(key) for key in tree) and session.exists()
    finally:
        kill_all(tree)
        root.wait()
