"""The rollout manager's HTTP client: `EngineClient` (aiohttp) against httpx, side by side, on a
rollout's calls to one engine.

    uv run python bench/engine_client.py [--rounds 200] [--groups 8] [--samples 8]

A round is what a rollout of the e2e benchmark sends: one batched /generate per group, all at
once, each answered with `--samples` SGLang-shaped answers (16 tokens with their log-probs). The
server answers at once from a canned body (no model), in a separate process as the engine is, so
the time is the two clients' and the HTTP stack's. Prints the median milliseconds per round of
each client and their ratio; the first 10% of rounds warm up and are left out.

Then the JSON of one such call, side by side: the standard library against `fast_json` (orjson),
reading and writing the request body and its answer, microseconds each (median of 2000).

    uv run python bench/engine_client.py --engine [--seconds 15]

instead sends the same rounds (1 new token per sample) to a reference engine on a tiny Qwen3
built here, started once with uvicorn's h11 parser and asyncio loop and once with its default
(httptools and uvloop), one after the other: the median milliseconds per round of each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from miles.backends.sglang_utils import fast_json
from miles.backends.sglang_utils.client import EngineClient
from miles.backends.sglang_utils.reference_engine.launcher import launch_reference_engine
from miles.backends.sglang_utils.server_process import free_port, http_probe
from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

RESPONSE_TOKENS = 16


def canned_answer(samples: int) -> bytes:
    rng = random.Random(0)
    one = {
        "text": "x" * 40,
        "output_ids": list(range(RESPONSE_TOKENS)),
        "meta_info": {
            "id": f"{rng.getrandbits(128):032x}",
            "finish_reason": {"type": "length", "length": RESPONSE_TOKENS},
            "prompt_tokens": 30,
            "completion_tokens": RESPONSE_TOKENS,
            "cached_tokens": 0,
            "output_token_logprobs": [[-3 * rng.random(), t, None] for t in range(RESPONSE_TOKENS)],
            "weight_version": "1",
        },
    }
    return json.dumps([one] * samples).encode()


def serve(port: int, samples: int) -> None:
    """A bare ASGI server: reads the body, answers the canned list (and 200 to /health)."""
    answer = canned_answer(samples)

    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        body = answer if scope["path"] == "/generate" else b"{}"
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")


def payload(samples: int) -> dict[str, Any]:
    return {
        "input_ids": [list(range(30))] * samples,
        "sampling_params": [
            {"temperature": 1.0, "max_new_tokens": RESPONSE_TOKENS, "sampling_seed": seed}
            for seed in range(samples)
        ],
        "return_logprob": True,
    }


async def rounds(call: Callable[[], Awaitable[Any]], args: argparse.Namespace) -> list[float]:
    seconds = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        answers = await asyncio.gather(*(call() for _ in range(args.groups)))
        seconds.append(time.perf_counter() - start)
        assert all(len(answer) == args.samples for answer in answers)
    return seconds[args.rounds // 10 :]


async def with_engine_client(url: str, args: argparse.Namespace) -> list[float]:
    body = payload(args.samples)
    async with EngineClient(url) as client:
        return await rounds(lambda: client.generate(body), args)


async def with_httpx(url: str, args: argparse.Namespace) -> list[float]:
    body = payload(args.samples)
    # The settings EngineClient used with httpx: a pool with room for every call, no proxies.
    limits = httpx.Limits(max_connections=272, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, trust_env=False) as client:

        async def call() -> Any:
            response = await client.post("/generate", json=body, timeout=60)
            response.raise_for_status()
            return response.json()

        return await rounds(call, args)


def json_costs(samples: int) -> None:
    request = json.dumps(payload(samples)).encode()
    answer = canned_answer(samples)
    items = json.loads(answer)
    cases = {
        "write the request": (
            lambda: json.dumps(payload(samples)).encode(),
            lambda: fast_json.dumps(payload(samples)),
        ),
        "read the request": (lambda: json.loads(request), lambda: fast_json.loads(request)),
        "write the answer": (
            lambda: json.dumps(items).encode(),
            lambda: fast_json.dumps(items),
        ),
        "read the answer": (lambda: json.loads(answer), lambda: fast_json.loads(answer)),
    }
    print(f"JSON of one call ({samples} samples), us: {'json':>8} {'fast_json':>10}")
    for name, (standard, fast) in cases.items():
        print(f"  {name:26} {_micros(standard):8.1f} {_micros(fast):10.1f}")


def _micros(fn: Callable[[], Any], repeats: int = 2000) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def against_engines(args: argparse.Namespace) -> None:
    body = payload(args.samples)
    for params in body["sampling_params"]:
        params["max_new_tokens"] = 1
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = build_tiny_checkpoint(Path(scratch) / "model", seed=0)
        medians = {}
        for name, flags in (("h11 + asyncio", ["--http", "h11", "--loop", "asyncio"]),
                            ("httptools + uvloop (default)", [])):  # fmt: skip
            with launch_reference_engine(checkpoint, extra_args=flags) as url:
                seconds = asyncio.run(timed_rounds(url, body, args))
            medians[name] = statistics.median(seconds) * 1000
            print(f"{name:30} {medians[name]:7.2f} ms per round of {args.groups} calls "
                  f"({len(seconds)} rounds)")  # fmt: skip
        ratio = medians["httptools + uvloop (default)"] / medians["h11 + asyncio"]
        print(f"default / h11 + asyncio: {ratio:.2f}")


async def timed_rounds(url: str, body: dict[str, Any], args: argparse.Namespace) -> list[float]:
    seconds = []
    async with EngineClient(url) as client:
        await client.wait_until_healthy(timeout_s=300, poll_s=0.2)
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            start = time.perf_counter()
            await asyncio.gather(*(client.generate(body) for _ in range(args.groups)))
            seconds.append(time.perf_counter() - start)
    return seconds[len(seconds) // 10 :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--groups", type=int, default=8, help="concurrent /generate calls")
    parser.add_argument("--samples", type=int, default=8, help="answers per call")
    parser.add_argument("--engine", action="store_true", help="against reference engines")
    parser.add_argument("--seconds", type=float, default=15.0, help="per engine (--engine)")
    args = parser.parse_args()
    if args.engine:
        against_engines(args)
        return
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(
        target=serve, args=(port, args.samples), daemon=True
    )
    server.start()
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not http_probe(f"{url}/health", timeout_s=1)[0]:
            assert time.monotonic() < deadline, "the canned server did not start"
            time.sleep(0.1)
        medians = {}
        for name, run in (("httpx", with_httpx), ("EngineClient (aiohttp)", with_engine_client)):
            medians[name] = statistics.median(asyncio.run(run(url, args))) * 1000
            print(f"{name:24} {medians[name]:7.2f} ms per round of {args.groups} calls")
        ratio = medians["httpx"] / medians["EngineClient (aiohttp)"]
        print(f"EngineClient is {ratio:.2f}x as fast as httpx per round")
        json_costs(args.samples)
    finally:
        server.terminate()
        server.join()


if __name__ == "__main__":
    main()
