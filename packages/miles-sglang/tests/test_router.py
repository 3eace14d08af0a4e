"""The real sglang-router in front of two tiny real HTTP workers that speak SGLang's API."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from miles.backends.sglang_utils.client import SyncEngineClient
from miles.backends.sglang_utils.router import (
    RouterConfig,
    RouterError,
    list_workers,
    running_router,
)
from miles.backends.sglang_utils.server_process import free_port


class Worker:
    """A tiny SGLang-shaped server that records every call and says who answered."""

    def __init__(self, name: str, model_path: str):
        self.name = name
        self.calls: list[str] = []
        self.generate_bodies: list[dict[str, Any]] = []
        self.app = FastAPI()
        app = self.app

        @app.middleware("http")
        async def record(request: Request, call_next):
            self.calls.append(f"{request.method} {request.url.path}")
            return await call_next(request)

        @app.get("/health")
        @app.get("/health_generate")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/get_server_info")
        async def server_info() -> dict[str, Any]:
            return {"model_path": model_path, "tp_size": 1, "dp_size": 1}

        @app.get("/get_model_info")
        async def model_info() -> dict[str, Any]:
            return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True}

        @app.post("/generate")
        async def generate(request: Request) -> dict[str, Any]:
            self.generate_bodies.append(await request.json())
            return {"text": self.name, "output_ids": [1], "meta_info": {"finish_reason": None}}

        @app.post("/flush_cache")
        async def flush_cache() -> Response:
            return Response(status_code=200)


@contextlib.contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run `app` with uvicorn in a thread on a free 127.0.0.1 port; yields its URL."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "test worker did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> Iterator[dict[str, Worker]]:
    """Two workers by URL. Their model_path is a local directory with no tokenizer, so the router's
    tokenizer lookup fails at once instead of asking the Hugging Face hub."""
    model_dir = str(tmp_path_factory.mktemp("model"))
    first, second = Worker("first", model_dir), Worker("second", model_dir)
    with serve(first.app) as first_url, serve(second.app) as second_url:
        yield {first_url: first, second_url: second}


@pytest.fixture(scope="module")
def router(workers, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    with running_router(list(workers), policy="round_robin", log_path=log_path) as router:
        yield router


def _process_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_requests_through_the_router_are_spread_over_both_workers(router, workers):
    with SyncEngineClient(router.url) as client:
        answers = [
            client.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
            for _ in range(8)
        ]
        assert client.health_generate() is True
        assert client.get_model_info()["is_generation"] is True
    served = collections.Counter(answer["text"] for answer in answers)
    assert served == {"first": 4, "second": 4}, "round robin alternates the two workers"


def test_router_keeps_the_sglang_generate_fields(router, workers):
    with SyncEngineClient(router.url) as client:
        client.generate(
            {
                "input_ids": [5, 6],
                "rid": "req-1",
                "return_logprob": True,
                "sampling_params": {"temperature": 0.5, "max_new_tokens": 3, "stop_token_ids": [2]},
            }
        )
    bodies = [body for worker in workers.values() for body in worker.generate_bodies]
    body = next(body for body in bodies if body.get("rid") == "req-1")
    assert body["input_ids"] == [5, 6] and body["return_logprob"] is True
    assert body["sampling_params"] == {
        "temperature": 0.5,
        "max_new_tokens": 3,
        "stop_token_ids": [2],
    }


def test_router_registers_workers_through_health_and_the_info_endpoints(router, workers):
    for worker in workers.values():
        assert "GET /health" in worker.calls
        assert "GET /get_server_info" in worker.calls  # after a 404 on /server_info
        assert "GET /get_model_info" in worker.calls  # after a 404 on /model_info


def test_router_fans_out_flush_cache_but_does_not_route_pause(router, workers):
    assert httpx.post(f"{router.url}/flush_cache", timeout=10).is_success
    assert all("POST /flush_cache" in worker.calls for worker in workers.values())
    pause = httpx.post(f"{router.url}/pause_generation", json={"mode": "abort"}, timeout=10)
    assert pause.status_code == 404, "pause goes to each engine's own URL, not the router"


def test_workers_can_be_added_and_removed_while_the_router_runs(workers, tmp_path):
    first_url, second_url = workers
    with running_router([first_url], log_path=tmp_path / "router.log") as router:
        router.add_worker(second_url)
        assert sorted(router.workers()) == sorted([first_url, second_url])
        router.remove_worker(first_url)
        assert router.workers() == [second_url]
        with SyncEngineClient(router.url) as client:
            assert {client.generate({"input_ids": [1]})["text"] for _ in range(4)} == {"second"}
        router.remove_worker(first_url)  # already gone: a no-op


def test_adding_a_dead_worker_times_out_naming_it(tmp_path):
    dead_url = f"http://127.0.0.1:{free_port()}"
    with running_router([], log_path=tmp_path / "router.log") as router:
        with pytest.raises(RouterError, match=rf"{dead_url} after 1 s.*GET /health"):
            router.add_worker(dead_url, timeout_s=1.0)


def test_shutdown_leaves_no_router_process(tmp_path):
    with running_router([], log_path=tmp_path / "router.log") as router:
        pid = router._process.pid  # type: ignore[union-attr]
        assert list_workers(router.url) == []
    assert not _process_alive(pid)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{router.url}/liveness", timeout=2)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="'fastest' is not one of random, round_robin"):
        RouterConfig(policy="fastest")  # type: ignore[arg-type]
