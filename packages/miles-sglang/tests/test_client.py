"""EngineClient against a real local HTTP server that answers with scripted statuses."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from miles.backends.sglang_utils.client import (
    EngineClient,
    EngineError,
    EngineTimeouts,
    SyncEngineClient,
)
from miles.backends.sglang_utils.server_process import free_port

FAST_RETRY = {"backoff_s": 0.05, "max_backoff_s": 0.2}


class Scripted:
    """Server-side record and script: what each endpoint answers next, and what it saw."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.script: dict[str, list[tuple[int, Any]]] = collections.defaultdict(list)
        self.bodies: dict[str, list[Any]] = collections.defaultdict(list)
        self.auth: list[str | None] = []
        self.delay_s = 0.0
        self.trickle_s: float | None = None  # answer /generate one byte every this many seconds
        self.in_flight = 0
        self.max_in_flight = 0

    def next_answer(self, endpoint: str) -> Response | None:
        self.calls[endpoint] += 1
        if not self.script[endpoint]:
            return None
        status, body = self.script[endpoint].pop(0)
        if isinstance(body, Response):
            return body
        if isinstance(body, str):
            return PlainTextResponse(body, status_code=status)
        return JSONResponse(body, status_code=status)


def build_app(state: Scripted) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def record_auth(request: Request, call_next):
        state.auth.append(request.headers.get("authorization"))
        return await call_next(request)

    def trickle(interval: float) -> StreamingResponse:
        async def chunks():
            for byte in b'{"text": "' + b"x" * 10_000:
                await asyncio.sleep(interval)
                yield bytes([byte])

        return StreamingResponse(chunks(), media_type="application/json")

    @app.get("/{endpoint}")
    async def get(endpoint: str):
        if state.trickle_s is not None and endpoint == "health":
            return trickle(state.trickle_s)
        return state.next_answer(endpoint) or {"endpoint": endpoint, "weight_version": "3"}

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        state.bodies["generate"].append(body)
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            await asyncio.sleep(state.delay_s)
        finally:
            state.in_flight -= 1
        answer = state.next_answer("generate")
        if answer is not None:
            return answer
        if state.trickle_s is not None:  # alive, never silent long enough for a read timeout
            return trickle(state.trickle_s)
        if body.get("stream"):
            chunks = [f'data: {{"text": "{t}"}}\n\n' for t in ("a", "ab", "abc")] + [
                "data: [DONE]\n\n"
            ]
            return StreamingResponse(iter(chunks), media_type="text/event-stream")
        return {
            "text": "ok",
            "output_ids": [1, 2],
            "meta_info": {"finish_reason": {"type": "stop"}},
        }

    @app.post("/{endpoint}")
    async def post(endpoint: str, request: Request):
        state.bodies[endpoint].append(await request.json())
        answer = state.next_answer(endpoint)
        if answer is not None:
            return answer
        if endpoint in ("abort_request", "flush_cache"):
            return Response(status_code=200)
        if endpoint in ("release_memory_occupation", "resume_memory_occupation"):
            return None  # SGLang's handlers return nothing: a JSON null
        return {"success": True, "message": f"{endpoint} done"}

    return app


@contextlib.contextmanager
def serve(app: FastAPI, port: int | None = None) -> Iterator[str]:
    """Run `app` with uvicorn in a thread on 127.0.0.1; yields its URL."""
    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "test server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, list[Scripted]]]:
    holder = [Scripted()]

    class Proxy:  # the app reads the current test's state through this
        def __getattr__(self, name: str) -> Any:
            return getattr(holder[0], name)

        def __setattr__(self, name: str, value: Any) -> None:
            setattr(holder[0], name, value)

    with serve(build_app(Proxy())) as url:  # type: ignore[arg-type]
        yield url, holder


@pytest.fixture
def engine(server: tuple[str, list[Scripted]]) -> tuple[str, Scripted]:
    url, holder = server
    holder[0] = Scripted()
    return url, holder[0]


def run(coroutine_factory, url: str, **client_kwargs: Any) -> Any:
    async def main() -> Any:
        async with EngineClient(url, **{**FAST_RETRY, **client_kwargs}) as client:
            return await coroutine_factory(client)

    return asyncio.run(main())


def test_get_retries_on_503_until_the_engine_answers(engine):
    url, state = engine
    state.script["get_server_info"] = [(503, {"error": {"message": "warming up"}})] * 2
    info = run(lambda c: c.get_server_info(), url, max_retries=3)
    assert info["endpoint"] == "get_server_info"
    assert state.calls["get_server_info"] == 3


def test_get_gives_up_after_the_retry_bound_and_reports_the_last_error(engine):
    url, state = engine
    state.script["get_model_info"] = [(503, {"message": "overloaded"})] * 5
    with pytest.raises(EngineError) as info:
        run(lambda c: c.get_model_info(), url, max_retries=2)
    assert state.calls["get_model_info"] == 3
    assert info.value.status == 503 and "overloaded" in str(info.value)


def test_get_is_not_retried_on_4xx(engine):
    url, state = engine
    state.script["get_model_info"] = [(400, {"error": {"message": "bad model"}})]
    with pytest.raises(EngineError, match="bad model"):
        run(lambda c: c.get_model_info(), url, max_retries=3)
    assert state.calls["get_model_info"] == 1


def test_a_503_is_retried_for_any_method_after_its_retry_after(engine):
    # A 503 (a full queue) means nothing was processed: even a POST is safe to send again.
    url, state = engine
    full = JSONResponse({"error": {"message": "queue full"}}, status_code=503,
                        headers={"Retry-After": "0.4"})  # fmt: skip
    state.script["generate"] = [(503, full)]
    start = time.monotonic()
    answer = run(lambda c: c.generate({"input_ids": [1]}), url, max_retries=3)
    assert time.monotonic() - start >= 0.4  # the server's Retry-After, not the 0.05 s backoff
    assert answer["text"] == "ok" and state.calls["generate"] == 2


def test_a_post_answered_with_another_5xx_is_not_sent_again(engine):
    url, state = engine
    state.script["generate"] = [(500, {"error": {"message": "scheduler died"}})]
    with pytest.raises(EngineError, match="scheduler died"):
        run(lambda c: c.generate({"input_ids": [1]}), url, max_retries=3)
    assert state.calls["generate"] == 1


def test_weight_update_is_never_retried_on_5xx(engine):
    url, state = engine
    state.script["update_weights_from_disk"] = [(500, "Internal Server Error")]
    with pytest.raises(EngineError, match="Internal Server Error"):
        run(lambda c: c.update_weights_from_disk("/ckpt"), url, max_retries=3)
    assert state.calls["update_weights_from_disk"] == 1


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"error": {"message": "nested message"}}, "nested message"),
        ({"object": "error", "message": "flat message", "code": 400}, "flat message"),
        ("plain text message", "plain text message"),
    ],
)
def test_errors_name_url_endpoint_status_and_the_servers_message(engine, body, expected):
    url, state = engine
    state.script["generate"] = [(400, body)]
    with pytest.raises(EngineError) as info:
        run(lambda c: c.generate({"text": "hi"}), url)
    text = str(info.value)
    assert url in text and "/generate" in text and "400" in text and expected in text
    assert (info.value.url, info.value.endpoint, info.value.status) == (url, "/generate", 400)
    assert info.value.server_message == expected


def test_get_retries_connection_refused_until_the_engine_comes_up():
    port = free_port()
    state = Scripted()
    started: list[contextlib.ExitStack] = []

    def start_late() -> None:
        time.sleep(0.4)
        stack = contextlib.ExitStack()
        stack.enter_context(serve(build_app(state), port))
        started.append(stack)

    thread = threading.Thread(target=start_late)
    thread.start()
    try:
        info = run(lambda c: c.get_server_info(), f"http://127.0.0.1:{port}", max_retries=30)
    finally:
        thread.join()
        for stack in started:
            stack.close()
    assert info["endpoint"] == "get_server_info"


def test_a_refused_post_is_sent_again_because_it_never_left():
    port = free_port()
    state = Scripted()
    with contextlib.ExitStack() as stack:
        timer = threading.Timer(0.4, lambda: stack.enter_context(serve(build_app(state), port)))
        timer.start()
        answer = run(lambda c: c.generate({"input_ids": [1]}), f"http://127.0.0.1:{port}",
                     max_retries=30)  # fmt: skip
        timer.join()
    assert answer["text"] == "ok" and state.calls["generate"] == 1


def test_a_refused_post_gives_up_after_the_retry_bound_naming_the_engine():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError) as info:
        run(lambda c: c.generate({"input_ids": [1]}), url, max_retries=2)
    assert info.value.status is None and "connection failed" in str(info.value)
    assert url in str(info.value) and "/generate" in str(info.value)


def test_a_trickling_answer_fails_at_the_calls_deadline(engine):
    # One byte every 0.1 s: a read timeout of 1 s never fires, the call's deadline does.
    url, state = engine
    state.trickle_s = 0.1
    start = time.monotonic()
    with pytest.raises(EngineError, match="no complete answer within 2 s"):
        run(lambda c: c.generate({"input_ids": [1]}), url,
            timeouts=EngineTimeouts(connect_s=0.5, generate_s=1.5))  # fmt: skip
    assert time.monotonic() - start < 3.0


def test_a_health_probe_of_a_trickling_server_ends_at_its_bound(engine):
    # /health answering one byte every 0.1 s: the probe says no within its 1 s bound.
    url, state = engine
    state.trickle_s = 0.1
    start = time.monotonic()
    assert run(lambda c: c.health(), url, timeouts=EngineTimeouts(control_s=1.0)) is False
    ok, why = run(lambda c: c.check_health(0.5), url)
    assert not ok and "no complete answer within 0.5 s" in why
    assert time.monotonic() - start < 3.0


def test_a_generate_deadline_follows_its_token_budget():
    timeouts = EngineTimeouts(control_s=5.0, generate_s=600.0, per_token_s=0.5)
    assert timeouts.generate_deadline_s({"sampling_params": {"max_new_tokens": 10}}) == 10.0
    batch = {"sampling_params": [{"max_new_tokens": 4}, {"max_new_tokens": 20}]}
    assert timeouts.generate_deadline_s(batch) == 15.0  # the longest sequence of the batch
    assert timeouts.generate_deadline_s({}) == 5.0 + 0.5 * 128  # SGLang's default budget
    assert timeouts.generate_deadline_s({"sampling_params": {"max_new_tokens": 10**6}}) == 600.0
    assert EngineTimeouts().generate_deadline_s({"sampling_params": {"max_new_tokens": 8}}) == 68.0
    unbounded = EngineTimeouts(per_token_s=None)
    assert unbounded.generate_deadline_s({"sampling_params": {"max_new_tokens": 8}}) == 3600.0


def test_concurrency_limit_bounds_generations_in_flight(engine):
    url, state = engine
    state.delay_s = 0.2

    async def many(client: EngineClient) -> list[Any]:
        return await asyncio.gather(*(client.generate({"input_ids": [i]}) for i in range(9)))

    answers = run(many, url, max_concurrency=3)
    assert len(answers) == 9
    assert state.max_in_flight == 3


def test_control_calls_bypass_the_generation_limit(engine):
    url, state = engine
    state.delay_s = 1.0

    async def pause_while_saturated(client: EngineClient) -> float:
        generation = asyncio.create_task(client.generate({"input_ids": [1]}))
        await asyncio.sleep(0.2)  # the only slot is now taken
        start = time.monotonic()
        await client.pause_generation("retract")
        elapsed = time.monotonic() - start
        await generation
        return elapsed

    assert run(pause_while_saturated, url, max_concurrency=1) < 0.5
    assert state.bodies["pause_generation"] == [{"mode": "retract"}]


def test_generation_read_timeout_fires(engine):
    url, state = engine
    state.delay_s = 3.0
    start = time.monotonic()
    with pytest.raises(EngineError, match="timed out"):
        run(
            lambda c: c.generate({"input_ids": [1]}),
            url,
            timeouts=EngineTimeouts(generate_s=0.3),
        )
    assert time.monotonic() - start < 2.0
    assert state.calls["generate"] == 0  # the server was still sleeping when the client left


def test_api_key_is_sent_as_bearer_token(engine):
    url, state = engine
    run(lambda c: c.health(), url, api_key="sekret")
    assert state.auth == ["Bearer sekret"]


def test_generate_stream_yields_chunks_until_done(engine):
    url, state = engine

    async def collect(client: EngineClient) -> list[dict]:
        return [chunk async for chunk in client.generate_stream({"text": "hi"})]

    assert [c["text"] for c in run(collect, url)] == ["a", "ab", "abc"]
    assert state.bodies["generate"][0]["stream"] is True


def test_generate_stream_raises_the_error_chunk(engine):
    url, state = engine
    state.script["generate"] = [(200, 'data: {"error": {"message": "too long"}}\n\n')]

    async def collect(client: EngineClient) -> list[dict]:
        return [chunk async for chunk in client.generate_stream({"text": "hi"})]

    with pytest.raises(EngineError, match="too long"):
        run(collect, url)


def test_generate_stream_reads_a_chunk_longer_than_a_line_buffer(engine):
    # A chunk carrying a long answer's log-probs is one SSE line that can pass the bound of
    # aiohttp's own line reader (512 KiB); it arrives split over many reads and CRLF-terminated.
    url, state = engine
    text = "x" * 1_000_000

    def pieces():
        line = f'data: {{"text": "{text}"}}\r\n\r\ndata: [DONE]\r\n\r\n'.encode()
        yield from (line[i : i + 70_000] for i in range(0, len(line), 70_000))

    state.script["generate"] = [(200, StreamingResponse(pieces()))]

    async def collect(client: EngineClient) -> list[dict]:
        return [chunk async for chunk in client.generate_stream({"text": "hi"})]

    assert [len(c["text"]) for c in run(collect, url)] == [len(text)]


def test_a_client_used_from_a_second_event_loop_says_so(engine):
    url, _ = engine
    client = EngineClient(url)
    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        assert first.run_until_complete(client.health())
        with pytest.raises(RuntimeError, match="second event loop"):
            second.run_until_complete(client.health())
        first.run_until_complete(client.aclose())
    finally:
        first.close()
        second.close()


def test_failed_weight_update_returns_sglangs_answer_instead_of_raising(engine):
    url, state = engine
    state.script["update_weights_from_tensor"] = [(400, {"success": False, "message": "bad shape"})]
    result = run(
        lambda c: c.update_weights_from_tensor(["b64"], weight_version="7"),
        url,
    )
    assert result == {"success": False, "message": "bad shape"}
    assert state.bodies["update_weights_from_tensor"] == [
        {"serialized_named_tensors": ["b64"], "flush_cache": True, "weight_version": "7"}
    ]


def test_weight_and_memory_calls_send_sglang_field_names(engine):
    url, state = engine
    import torch

    async def calls(client: EngineClient) -> list[Any]:
        return [
            await client.init_weights_update_group("10.0.0.1", 29500, 1, 3, "g", "gloo"),
            await client.update_weights_from_distributed(
                ["w"], [torch.bfloat16], [(2, 3)], group_name="g", weight_version="1"
            ),
            await client.destroy_weights_update_group("g"),
            await client.release_memory_occupation(["kv_cache"]),
            await client.resume_memory_occupation(),
        ]

    results = run(calls, url)
    assert all(result["success"] is True for result in results)
    assert state.bodies["init_weights_update_group"] == [
        {
            "master_address": "10.0.0.1",
            "master_port": 29500,
            "rank_offset": 1,
            "world_size": 3,
            "group_name": "g",
            "backend": "gloo",
        }
    ]
    assert state.bodies["update_weights_from_distributed"] == [
        {
            "names": ["w"],
            "dtypes": ["bfloat16"],
            "shapes": [[2, 3]],
            "group_name": "g",
            "flush_cache": True,
            "weight_version": "1",
        }
    ]
    assert state.bodies["release_memory_occupation"] == [{"tags": ["kv_cache"]}]
    assert state.bodies["resume_memory_occupation"] == [{}]


def test_health_probes_report_false_instead_of_raising(engine):
    url, state = engine
    state.script["health_generate"] = [(503, "")]

    async def probes(client: EngineClient) -> tuple[bool, bool, bool]:
        return await client.health(), await client.health_generate(), await client.health_generate()

    assert run(probes, url) == (True, False, True)
    dead = f"http://127.0.0.1:{free_port()}"
    assert run(lambda c: c.health(), dead) is False


def test_wait_until_healthy_polls_then_times_out_with_the_last_answer(engine):
    url, state = engine
    state.script["health_generate"] = [(503, "loading")] * 2
    run(lambda c: c.wait_until_healthy(timeout_s=5, poll_s=0.05), url)
    assert state.calls["health_generate"] == 3

    state.script["health_generate"] = [(503, "still loading")] * 100
    with pytest.raises(EngineError, match="still loading"):
        run(lambda c: c.wait_until_healthy(timeout_s=0.3, poll_s=0.05), url)


def test_pause_mode_is_validated_before_sending(engine):
    url, state = engine
    with pytest.raises(ValueError, match="in_place"):
        run(lambda c: c.pause_generation("stop"), url)
    assert state.calls["pause_generation"] == 0


def test_sync_client_is_usable_from_many_threads(engine):
    url, state = engine
    state.delay_s = 0.05
    with SyncEngineClient(url, max_concurrency=2) as client:
        results: list[Any] = []

        def work(i: int) -> None:
            results.append(client.generate({"input_ids": [i]}))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(results) == 6 and state.max_in_flight <= 2
        assert client.get_model_info()["weight_version"] == "3"
        assert [c["text"] for c in client.generate_stream({"text": "x"})] == ["a", "ab", "abc"]
        client.abort_request(abort_all=True)
        assert state.bodies["abort_request"] == [{"rid": "", "abort_all": True}]
    with pytest.raises(RuntimeError, match="closed"):
        client.health()
