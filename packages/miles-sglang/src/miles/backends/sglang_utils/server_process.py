"""A server subprocess owned as a whole process tree: own session, log file, readiness wait.

The generic part under every server miles starts (SGLang, the reference engine, sglang-router), so
that the launchers and the router wiring build on it without importing each other. A server dies
with the process that started it (on Linux), even when that one is SIGKILLed: a Ray actor killed
with its driver leaves no engine behind.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from miles.backends.sglang_utils.engine_error import server_message

logger = logging.getLogger(__name__)


ADMIN_KEY_ENV = "MILES_ENGINE_ADMIN_API_KEY"
"""Where a launched reference engine reads its --admin-api-key: in its environment, so the key
never shows in the process list."""


def file_tail(path: str | Path, lines: int) -> str:
    """The last `lines` lines of a (log) file, read from its last 64 KiB."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
        text = f.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Looked up before any fork: the child between fork and exec must not import or take locks.
_LIBC = (
    ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if os.uname().sysname == "Linux"
    else None
)


def _die_with_parent() -> None:
    """In the child, before exec: the kernel SIGKILLs it when the thread that started it exits
    (the actor's worker thread, which lives as long as its process). It also unblocks SIGTERM
    and SIGINT, which Ray's processes block and pass on (`miles.ray.local_ray`): the server must
    stop on `shutdown`'s SIGTERM."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ServerStartError(RuntimeError):
    """A server process exited or stayed unhealthy while starting; carries its last log lines."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now (another process may still take it before it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def http_probe(url: str, timeout_s: float = 30.0) -> tuple[bool, str]:
    """One GET: (answered 2xx, what it answered). Never raises for network errors."""
    try:
        response = httpx.get(url, timeout=timeout_s, trust_env=False)
    except httpx.HTTPError as exc:
        return False, f"{type(exc).__name__}: {exc}"
    if response.is_success:
        return True, f"HTTP {response.status_code}"
    return False, f"HTTP {response.status_code}: {server_message(response)}"


def _process_group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is left in the group."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # exited while we looked
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        state, _ppid, pgrp = stat.rpartition(")")[2].split()[:3]
        if int(pgrp) == pgid and state not in ("Z", "X"):
            return True
    return False


class ServerProcess:
    """A server subprocess in its own session, so `shutdown` reaches every process it spawned.

    Output goes to a log file whose tail explains a failed start. An atexit hook shuts down what
    the owner forgot; nothing can catch its own SIGKILL, so owners should call `shutdown`.
    """

    def __init__(
        self,
        command: list[str],
        *,
        name: str,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
    ):
        """`env`: variables set for the server on top of this process's environment."""
        self.name = name
        self.command = command
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"{name.replace(' ', '-')}-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "ab")  # closed by shutdown
        try:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killpg reaches the whole tree
                preexec_fn=_die_with_parent,
                env={**os.environ, **env} if env else None,
            )
        except OSError:
            self._log.close()
            raise
        atexit.register(self.shutdown)
        logger.info("started %s (pid %d), log %s", name, self.pid, self.log_path)

    @property
    def pid(self) -> int:
        return self._process.pid

    def poll(self) -> int | None:
        """The exit code of the top process, or None while it runs."""
        return self._process.poll()

    def log_tail(self, lines: int = 40) -> str:
        """The last lines the server wrote."""
        return file_tail(self.log_path, lines)

    def wait_until_ready(self, probe_url: str, *, timeout_s: float, poll_s: float = 0.5) -> None:
        """Poll `probe_url` until it answers 2xx; fail fast if the process exits.

        On failure the process tree is shut down and ServerStartError carries the log's tail.
        """
        start = time.monotonic()
        next_log = start + 5.0
        while True:
            ok, answer = http_probe(probe_url)
            elapsed = time.monotonic() - start
            if ok:
                logger.info("%s answers %s after %.1f s", self.name, probe_url, elapsed)
                return
            exit_code = self.poll()
            if exit_code is not None or elapsed >= timeout_s:
                self.shutdown()
                what = (
                    f"exited with code {exit_code} before answering {probe_url}"
                    if exit_code is not None
                    else f"did not answer {probe_url} within {timeout_s:.0f} s "
                    f"(last answer: {answer}); raise the startup timeout if it is still loading"
                )
                raise ServerStartError(
                    f"{self.name} (pid {self.pid}) {what}; last lines of {self.log_path}:\n"
                    + self.log_tail()
                )
            if time.monotonic() >= next_log:
                logger.info(
                    "waiting for %s (pid %d) to answer %s: %.0f s of %.0f s (last answer: %s)",
                    self.name,
                    self.pid,
                    probe_url,
                    elapsed,
                    timeout_s,
                    answer,
                )
                next_log += 10.0
            time.sleep(poll_s)

    def shutdown(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after `grace_s`; idempotent."""
        if self._log.closed:
            return  # already stopped: its group id may belong to someone else by now
        atexit.unregister(self.shutdown)
        pgid = self.pid  # start_new_session made the top process the group leader
        _signal_group(pgid, signal.SIGTERM)
        if not self._wait_group_exit(pgid, grace_s):
            logger.warning("%s ignored SIGTERM for %.0f s; sending SIGKILL", self.name, grace_s)
            _signal_group(pgid, signal.SIGKILL)
            if not self._wait_group_exit(pgid, 5.0):
                logger.error("%s: processes of group %d survived SIGKILL", self.name, pgid)
        self._process.wait()  # reap the leader
        self._log.close()
        logger.info("%s (pid %d) stopped with code %s", self.name, self.pid, self.poll())

    def _wait_group_exit(self, pgid: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            self._process.poll()  # reap the leader, so a zombie does not count as alive
            if not _process_group_alive(pgid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # the group emptied in the meantime
