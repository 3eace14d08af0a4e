"""py-spy sampling of a Python process (--profile-target rollout-manager): a Chrome trace of its
Python stacks, 100 samples a second, without stopping it (--nonblocking). Idle stacks count
(--idle): the rollout manager mostly waits on engines, and where it waits is what to see.

py-spy reads the target's memory with ptrace: it needs the same user and, where the kernel's
Yama ptrace_scope is 1 or more, CAP_SYS_PTRACE (in Docker: --cap-add SYS_PTRACE). A refused attach
is an error that says so.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from miles.utils.observability.config import py_spy_path

_UNBLOCK_SIGINT_AND_EXEC = (
    "import os, signal, sys; signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT]); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)
# The longest py-spy takes to attach (it fails at once when it cannot) and to write its trace.
_ATTACH_S = 5.0
_WRITE_S = 60.0


class PySpyRecording:
    """py-spy recording `pid` into `path` (Chrome trace JSON) until `stop()`."""

    def __init__(self, pid: int, path: str | Path, *, rate: int = 100) -> None:
        executable = py_spy_path()
        if executable is None:
            raise RuntimeError("py-spy is not installed; run `uv pip install 'miles[profile]'`")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.path.with_suffix(".py-spy.log")
        record = [executable, "record", "--pid", str(pid), "--format", "chrometrace",
                  "--output", str(self.path), "--rate", str(rate), "--nonblocking",
                  "--idle"]  # fmt: skip
        # Ray runs actor calls on threads that block SIGINT, and a blocked signal stays blocked
        # across exec: py-spy would never see the Ctrl-C on which it writes its trace. The
        # shim unblocks it, then becomes py-spy.
        command = [sys.executable, "-c", _UNBLOCK_SIGINT_AND_EXEC, *record]
        with self._log.open("w") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        if not self._attached(pid):
            raise RuntimeError(
                f"py-spy could not sample pid {pid}: {self._log.read_text().strip()[-500:]} "
                "(it needs ptrace rights: CAP_SYS_PTRACE, or kernel.yama.ptrace_scope 0)"
            )

    def _attached(self, pid: int) -> bool:
        """Whether py-spy samples: it says so on its first line, or exits when it cannot."""
        deadline = time.monotonic() + _ATTACH_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                return False
            if "Sampling process" in self._log.read_text():
                return True
            time.sleep(0.02)
        return self._process.poll() is None  # still running: it attached without saying so

    def stop(self) -> Path:
        """Stop sampling and wait for the trace file; returns its path."""
        self._process.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
        try:
            self._process.wait(timeout=_WRITE_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if not self.path.is_file():
            raise RuntimeError(f"py-spy wrote no trace: {self._log.read_text().strip()[-500:]}")
        self._log.unlink(missing_ok=True)
        return self.path
