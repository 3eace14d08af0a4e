"""Start a reference engine as its own process and stop its whole process tree afterwards.

What tests, benchmarks and a CPU rollout use to get an engine URL; the engine runs
`python -m miles.backends.sglang_utils.reference_engine.cli` with the same interpreter.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from miles.backends.sglang_utils.server_process import ServerProcess, free_port


@contextmanager
def reference_engine_process(
    model_path: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float = 300.0,
    log_path: str | Path | None = None,
) -> Iterator[tuple[str, ServerProcess]]:
    """Yield the URL of a reference engine serving `model_path` once `/health` answers, and its
    process: the engine itself (its pid is the engine's, e.g. for reading its memory)."""
    port = port or free_port(host)
    command = [
        sys.executable, "-m", "miles.backends.sglang_utils.reference_engine.cli",
        "--model-path", str(model_path), "--host", host, "--port", str(port),
        "--log-level", "warning", *extra_args,
    ]  # fmt: skip
    process = ServerProcess(command, name=f"reference-engine-{port}", log_path=log_path)
    try:
        process.wait_until_ready(f"http://{host}:{port}/health", timeout_s=timeout_s)
        yield f"http://{host}:{port}", process
    finally:
        process.shutdown()


@contextmanager
def launch_reference_engine(model_path: str | Path, **options: Any) -> Iterator[str]:
    """Yield the URL of a reference engine serving `model_path` once `/health` answers;
    `options` are `reference_engine_process`'s."""
    with reference_engine_process(model_path, **options) as (url, _process):
        yield url
