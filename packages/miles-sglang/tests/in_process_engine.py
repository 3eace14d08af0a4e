"""A reference engine served from the test process: uvicorn in a thread on 127.0.0.1, with the
engine's internals in reach. It starts in about a second, where a server process takes ten or more
on a loaded 2-core machine; the engine code, routes and HTTP are the same."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn

from miles.backends.sglang_utils.reference_engine import (
    ReferenceEngine,
    ReferenceEngineConfig,
    create_app,
)
from miles.backends.sglang_utils.server_process import free_port


@contextlib.contextmanager
def serve_in_process(
    config: ReferenceEngineConfig, *, headers: dict[str, str] | None = None
) -> Iterator[tuple[ReferenceEngine, httpx.Client]]:
    """The engine of `config` and a client of its server (base_url set, `headers` on every call);
    the server and the engine stop afterwards."""
    engine = ReferenceEngine(config)
    port = free_port("127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))  # fmt: skip
    thread = threading.Thread(target=server.run, name=f"engine-server-{port}", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, headers=headers or {}, timeout=120) as client:
            yield engine, client
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.scheduler.shutdown()
