"""A run owns its directories (miles.utils.run_lock), with real processes: a live owner's
directory is refused naming it; a dead owner's lock (its pid gone, or another host's lock without
a heartbeat) is taken over with a warning; a run removes only its own locks; the heartbeat keeps
a lock fresh."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from miles.utils import run_lock
from miles.utils.run_dirs import RunDirectoryError
from miles.utils.run_lock import LOCK_FILE, DirectoryInUseError, RunLock

HOLD = """
import sys, time
from miles.utils.run_lock import RunLock
lock = RunLock({"--output-dir": sys.argv[1]})
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding tmp_path/"out"; killed (SIGKILL) at the end if still alive."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "out")],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert process.stdout.readline().strip() == "held"
    yield process
    if process.poll() is None:
        process.kill()
        process.wait(timeout=30)


def test_a_directory_held_by_a_live_run_is_refused_naming_it_then_taken_when_it_dies(
    tmp_path, holder, caplog
):
    with pytest.raises(DirectoryInUseError, match=rf"--output-dir {tmp_path / 'out'} is in use "
                       rf"by another run \(pid {holder.pid} on "):  # fmt: skip
        RunLock({"--output-dir": str(tmp_path / "out"), "--save": str(tmp_path / "save")})
    assert not (tmp_path / "save" / LOCK_FILE).exists()  # nothing of a refused run is left
    assert issubclass(DirectoryInUseError, RunDirectoryError)  # `miles train`: one line, rc 2

    holder.send_signal(signal.SIGKILL)  # a crashed run: its lock stays behind
    holder.wait(timeout=30)
    with caplog.at_level(logging.WARNING, logger="miles.utils.run_lock"):
        with RunLock({"--output-dir": str(tmp_path / "out")}) as lock:
            owner = json.loads((tmp_path / "out" / LOCK_FILE).read_text())
            assert owner["pid"] == os.getpid() and owner["token"] == lock.owner.token
    assert f"pid {holder.pid} is not running" in caplog.text
    assert not (tmp_path / "out" / LOCK_FILE).exists()  # released


def test_another_hosts_lock_is_live_while_it_beats_and_stale_after(tmp_path, caplog):
    out = tmp_path / "out"
    out.mkdir()
    lock_file = out / LOCK_FILE
    lock_file.write_text(json.dumps({"pid": 1, "host": "node-7", "started_at": time.time(),
                                     "token": "theirs"}))  # fmt: skip
    with pytest.raises(DirectoryInUseError, match=r"pid 1 on node-7"):
        RunLock({"--output-dir": str(out)})
    old = time.time() - run_lock.STALE_AFTER_S - 5
    os.utime(lock_file, (old, old))
    with caplog.at_level(logging.WARNING, logger="miles.utils.run_lock"):
        RunLock({"--output-dir": str(out)}).release()
    assert "no heartbeat for" in caplog.text


def test_a_run_removes_only_its_own_lock_and_its_heartbeat_keeps_it_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = RunLock({"--output-dir": str(tmp_path), "--save": str(tmp_path)})  # one lock
    path = tmp_path / LOCK_FILE
    old = time.time() - 100
    os.utime(path, (old, old))
    deadline = time.monotonic() + 10
    while path.stat().st_mtime < time.time() - 50:
        assert time.monotonic() < deadline, "the heartbeat never touched the lock"
        time.sleep(0.05)
    # Someone else's lock now (the file replaced behind our back): release leaves it alone.
    path.write_text(json.dumps({"pid": 1, "host": "x", "started_at": 0.0, "token": "later"}))
    lock.release()
    assert json.loads(path.read_text())["token"] == "later"
