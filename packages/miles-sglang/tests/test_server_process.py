"""A server subprocess dies with the process that started it, even a SIGKILLed one, and stops on
SIGTERM even when its starter blocks SIGTERM (as Ray's processes do): real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

# Blocks SIGTERM (a Ray worker's mask), starts a server that sleeps, prints its pid, then waits.
_STARTER = """
import signal, sys, time
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
from miles.backends.sglang_utils.server_process import ServerProcess
server = ServerProcess([sys.executable, "-c", "import time; time.sleep(120)"], name="sleeper")
print(server.pid, flush=True)
if sys.argv[1] == "shutdown":
    began = time.monotonic()
    server.shutdown()
    print(round(time.monotonic() - began, 1), flush=True)
else:
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_server_dies_with_a_sigkilled_starter():
    starter = subprocess.Popen([sys.executable, "-c", _STARTER, "wait"], stdout=subprocess.PIPE)
    server = int(starter.stdout.readline())
    try:
        assert _alive(server)
        starter.kill()
        starter.wait()
        deadline = time.monotonic() + 5
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server)
    finally:
        if _alive(server):
            os.kill(server, signal.SIGKILL)


def test_a_server_started_with_sigterm_blocked_stops_on_sigterm():
    starter = subprocess.run(
        [sys.executable, "-c", _STARTER, "shutdown"], capture_output=True, text=True, timeout=60
    )
    server, seconds = starter.stdout.split()
    assert not _alive(int(server))
    assert float(seconds) < 5, "it waited for the SIGKILL after the grace: SIGTERM stayed blocked"
