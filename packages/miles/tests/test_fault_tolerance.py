"""Engine fault tolerance below the run: the supervisor finds a hung engine within its bound,
restarts it and admits it once it has the weights, and gives up past --max-engine-restarts naming
the engine and its log; without fault tolerance a hung engine fails its request within the
request bound. An external engine (no restart: the run did not launch it) stays lost, and the
rollout goes on with the others until none is left. (The pool's and the rollout's part: test_engine_pool, test_generate_rollout.)

The live engine is a real reference engine (the shared fixture); a hung engine is a real socket
that accepts connections and never answers, and a restarted one a real HTTP server on its port.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles.backends.sglang_utils.client import EngineError
from miles.rollout.engine_pool import EngineLostError, EnginePool, EngineUnavailableError
from miles.rollout.engine_supervisor import (
    EngineState,
    EngineSupervisor,
    FaultToleranceConfig,
)


def long_request(max_new_tokens: int) -> dict:
    return {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": max_new_tokens,
            "ignore_eos": True}, "return_logprob": True}  # fmt: skip


class HungEngine:
    """A listening socket that accepts connections and never answers: a frozen server."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.sock.accept()
            except OSError:
                return  # closed
            self._on_connection(connection)

    def _on_connection(self, connection: socket.socket) -> None:
        self._accepted.append(connection)  # held open, never answered

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread, frees the port
        except OSError:
            pass  # closed already
        self.sock.close()
        for connection in self._accepted:
            connection.close()


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"weight_version": "7"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def serve_healthy(port: int) -> ThreadingHTTPServer:
    """An HTTP server answering 200 on `port` (the engine, restarted at its URL)."""
    server = ThreadingHTTPServer(("127.0.0.1", port), _Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def hung() -> Iterator[HungEngine]:
    engine = HungEngine()
    yield engine
    engine.close()


async def _generate_until_unavailable(pool: EnginePool) -> EngineUnavailableError:
    """Send a request again after each loss, as a rollout does, until no engine can serve."""
    with pytest.raises(EngineUnavailableError) as caught:
        while True:
            try:
                await pool.generate(long_request(3))
            except EngineLostError:
                continue
    return caught.value


def test_without_fault_tolerance_a_hung_engine_fails_its_request_within_the_bound(hung):
    async def run():
        async with EnginePool([hung.url], timeout_s=1.5) as pool:
            started = time.monotonic()
            with pytest.raises(EngineError, match=f"/generate at {hung.url} failed .*timed out"):
                await pool.generate(long_request(4))
            return time.monotonic() - started

    assert 1.4 < asyncio.run(run()) < 5.0


def _supervisor(pool, restart, *, max_restarts=2, needs_weights=True):
    config = FaultToleranceConfig(
        interval_s=0.2, timeout_s=0.5, max_restarts=max_restarts, needs_weights=needs_weights
    )
    return EngineSupervisor(
        pool, config, restart=restart, log_tail=lambda index: f"  the last words of engine {index}"
    )


def test_the_supervisor_restarts_a_hung_engine_and_admits_it_with_the_weights(engine_url, hung):
    restarted: list[int] = []
    servers: list[ThreadingHTTPServer] = []

    async def restart(index: int) -> None:
        hung.close()  # what is left of the frozen engine
        servers.append(serve_healthy(hung.port))
        restarted.append(index)

    async def run():
        async with EnginePool([engine_url, hung.url], fault_tolerant=True) as pool:
            supervisor = _supervisor(pool, restart)
            supervisor.start()
            started = time.monotonic()
            while not supervisor.awaiting_weights():
                assert time.monotonic() - started < 10, supervisor.states
                await asyncio.sleep(0.05)
            detected_s = time.monotonic() - started
            awaiting = await supervisor.wait_restarted(timeout_s=10)
            serving_before = pool.serving()
            answer = await pool.generate(long_request(3))  # only the live engine serves
            await supervisor.admit(awaiting)
            metrics = supervisor.metrics()
            await supervisor.stop()
            return detected_s, awaiting, serving_before, answer, pool.serving(), metrics

    try:
        detected_s, awaiting, serving_before, answer, serving, metrics = asyncio.run(run())
    finally:
        for server in servers:
            server.shutdown()
    assert restarted == [1]
    assert detected_s < 0.2 + 0.5 + 1.0  # one interval and one timeout, and scheduling slack
    assert awaiting == [hung.url] and serving_before == [engine_url]
    assert len(answer["output_ids"]) == 3
    assert serving == [engine_url, hung.url]
    assert metrics["engine/restarts"] == 1 and metrics["engine/seconds_lost"] > 0


class ResettingEngine(HungEngine):
    """A socket that accepts each connection and resets it (RST): an engine going down."""

    def _on_connection(self, connection: socket.socket) -> None:
        # SO_LINGER with a zero timeout: close() sends RST instead of FIN.
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)
        connection.close()


@pytest.mark.parametrize("failure", ["reset", "hung"])
def test_a_lost_engine_is_reported_with_the_real_cause_of_its_failed_health_check(failure, caplog):
    engine = ResettingEngine() if failure == "reset" else HungEngine()

    async def restart(index: int) -> None:
        raise RuntimeError("not restarted in this test")

    async def run():
        async with EnginePool([engine.url], fault_tolerant=True) as pool:
            lost = await _supervisor(pool, restart, max_restarts=0).check_now()
            return lost

    try:
        with caplog.at_level(logging.WARNING, logger="miles.rollout.engine_pool"):
            assert asyncio.run(run()) == [engine.url]
    finally:
        engine.close()
    left = next(r.getMessage() for r in caplog.records if "left service" in r.getMessage())
    if failure == "reset":
        assert "/health failed: " in left and "no complete answer" not in left
        assert "reset" in left.lower() or "disconnected" in left.lower(), left
    else:
        assert "/health failed: TimeoutError: no complete answer within 0.5 s" in left


def test_an_engine_that_keeps_failing_stops_the_rollout_naming_it_and_its_log(hung):
    attempts: list[int] = []

    async def restart(index: int) -> None:
        attempts.append(index)
        raise RuntimeError("the engine exited with code 1 while loading")

    async def run():
        async with EnginePool([hung.url], fault_tolerant=True, timeout_s=30) as pool:
            supervisor = _supervisor(pool, restart, max_restarts=2)
            supervisor.start()
            started = time.monotonic()
            unavailable = await _generate_until_unavailable(pool)
            await supervisor.stop()
            return str(unavailable), time.monotonic() - started, supervisor.states

    message, elapsed_s, states = asyncio.run(run())
    assert attempts == [0, 0]
    assert message.startswith(
        f"engine 0 at {hung.url} failed again after 2 restart(s) "
        "(--max-engine-restarts 2): restart failed: the engine exited"
    )
    assert message.endswith("the last words of engine 0")
    assert states == {hung.url: EngineState.FAILED}
    assert elapsed_s < 5.0


def test_an_engine_failure_names_the_engine_and_quotes_the_end_of_its_log(
    tiny_checkpoint, tmp_path
):
    from miles.config import load_config
    from miles.ray.engine_fleet import EngineFailedError, EngineFleet

    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    config = load_config(["--hf-checkpoint", str(tiny_checkpoint), "--prompt-data", str(data),
                          "--rollout-batch-size", "1"])  # fmt: skip
    fleet = EngineFleet(config, None)
    log = tmp_path / "engine_0.log"
    log.write_text("".join(f"line {i}\n" for i in range(30)) + "CUDA error: device lost\n")
    fleet.engine_urls = ["http://10.0.0.1:30000"]
    fleet._engine_specs = [{"log_path": str(log)}]
    error = EngineError("http://10.0.0.1:30000/", "/generate", None, "connection failed")
    explained = fleet.explain(error)
    assert isinstance(explained, EngineFailedError)
    lines = str(explained).splitlines()
    assert lines[0].startswith("engine 0 at http://10.0.0.1:30000 failed: /generate at ")
    assert lines[1] == f"the end of its log ({log}):"
    assert lines[-1] == "  CUDA error: device lost" and len(lines) == 2 + 20


def test_a_lost_external_engine_stays_lost_and_the_others_serve(engine_url, hung):
    async def run():
        async with EnginePool([engine_url, hung.url], fault_tolerant=True) as pool:
            supervisor = _supervisor(pool, restart=None)
            supervisor.start()
            started = time.monotonic()
            while not supervisor.lost_for_good():
                assert time.monotonic() - started < 10, supervisor.states
                await asyncio.sleep(0.05)
            awaiting = await supervisor.wait_restarted(timeout_s=1)  # nothing restarts
            answer = await pool.generate(long_request(3))
            metrics = supervisor.metrics()
            await supervisor.stop()
            return supervisor.states, awaiting, pool.serving(), answer, metrics

    states, awaiting, serving, answer, metrics = asyncio.run(run())
    assert states == {engine_url: EngineState.SERVING, hung.url: EngineState.LOST}
    assert awaiting == [] and serving == [engine_url]
    assert len(answer["output_ids"]) == 3
    assert metrics["engine/lost_for_good"] == 1 and metrics["engine/restarts"] == 0
    assert metrics["engine/serving"] == 1


def test_when_every_external_engine_is_lost_the_rollout_stops_saying_so(hung):
    async def run():
        async with EnginePool([hung.url], fault_tolerant=True, timeout_s=30) as pool:
            supervisor = _supervisor(pool, restart=None)
            supervisor.start()
            started = time.monotonic()
            unavailable = await _generate_until_unavailable(pool)
            await supervisor.stop()
            return str(unavailable), time.monotonic() - started

    message, elapsed_s = asyncio.run(run())
    assert message.startswith(f"every external engine is lost (the last, {hung.url}: ")
    assert "cannot restart engines it did not launch" in message
    assert elapsed_s < 5.0
