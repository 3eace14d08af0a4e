"""Shared fixtures: a tiny local checkpoint and real reference-engine servers on loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_engine(model_path: Path, *extra: str, timeout_s: float = 120.0) -> Iterator[str]:
    """A `miles-reference-engine` process on a free loopback port; yields its URL, then stops it."""
    port = free_port()
    script = Path(sys.prefix) / "bin" / "miles-reference-engine"
    command = [
        str(script),
        "--model-path",
        str(model_path),
        "--port",
        str(port),
        "--log-level",
        "warning",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen(command, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"engine exited with {process.returncode} before serving: {command}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine at {url} not healthy after {timeout_s} s")
            time.sleep(0.2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), seed=0)


@pytest.fixture(scope="session")
def other_checkpoint(tmp_path_factory) -> Path:
    """Same architecture, different weights: what a trainer would push after a step."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-other"), seed=1)


@pytest.fixture(scope="session")
def engine_url(tiny_checkpoint) -> Iterator[str]:
    """A shared engine for tests that do not change its weights or memory."""
    with running_engine(tiny_checkpoint, "--random-seed", "0") as url:
        yield url


@pytest.fixture(scope="session")
def start_engine():
    """`start_engine(model_path, *flags)`: a context manager running a private engine."""
    return running_engine
