"""`--rm-type remote` against real HTTP servers on 127.0.0.1: retries, 4xx, timeouts, batching."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from miles.backends.training_utils.batching.sample import Sample
from miles.rollout.rewards import RemoteRewardModel, RewardConfig, RewardHub

# (payload, request number from 1) -> (status, JSON body, seconds to sleep before answering)
Behaviour = Callable[[Any, int], tuple[int, Any, float]]


@contextmanager
def reward_server(behaviour: Behaviour) -> Iterator[tuple[str, list[Any]]]:
    """A reward server on a free loopback port; yields its URL and the payloads it received."""
    received: list[Any] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                received.append(payload)
                number = len(received)
            status, body, delay = behaviour(payload, number)
            time.sleep(delay)
            data = json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client gave up (a timeout test)
                pass

        def log_message(self, *args: object) -> None:  # keep test output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score", received
    finally:
        server.shutdown()
        server.server_close()


def judge(item: dict) -> float:
    return 1.0 if item["response"] == item["label"] else 0.0


def correctness(payload: Any, number: int) -> tuple[int, Any, float]:
    if isinstance(payload, list):
        return 200, [judge(item) for item in payload], 0.0
    return 200, {"reward": judge(payload), "detail": "x"}, 0.0


def make_sample(response: str, label: str = "yes", group: int | None = None) -> Sample:
    return Sample(
        prompt="q",
        tokens=[1, 2, 3],
        response=response,
        response_length=1,
        label=label,
        group_index=group,
        metadata={"source": "test", "not_json": {1, 2}},
    )


def score(url: str, samples: list[Sample], **kwargs):
    async def run():
        async with RewardHub(RewardConfig(rm_type="remote", rm_url=url, **kwargs)) as hub:
            return await hub.score(samples)

    return asyncio.run(run())


def test_remote_rewards_come_from_the_server_with_the_sample_fields_sent():
    with reward_server(correctness) as (url, received):
        report = score(url, [make_sample("yes"), make_sample("no")])
    assert report.rewards == [1.0, 0.0] and report.failures == 0
    first = next(p for p in received if p["response"] == "yes")
    assert first == {
        "prompt": "q",
        "response": "yes",
        "label": "yes",
        "metadata": {"source": "test", "not_json": "{1, 2}"},
    }


def test_reward_key_picks_the_reward_from_a_dict_answer():
    with reward_server(lambda payload, n: (200, {"score": 0.75}, 0.0)) as (url, _):
        assert score(url, [make_sample("a")], reward_key="score").rewards == [0.75]


def test_a_5xx_is_retried_and_the_retry_succeeds():
    def fails_once(payload: Any, number: int) -> tuple[int, Any, float]:
        if number == 1:
            return 500, {"error": "warming up"}, 0.0
        return correctness(payload, number)

    with reward_server(fails_once) as (url, received):
        report = score(url, [make_sample("yes")])
    assert report.rewards == [1.0] and report.failures == 0
    assert len(received) == 2


def test_a_5xx_that_persists_fails_after_bounded_retries():
    with reward_server(lambda payload, n: (503, {"error": "overloaded"}, 0.0)) as (url, received):
        report = score(url, [make_sample("yes")], rm_max_retries=1, reward_failure_score=-1.0)
    assert report.rewards == [-1.0] and report.failures == 1
    assert len(received) == 2
    assert "HTTP 503" in report.failure_messages[0] and "overloaded" in report.failure_messages[0]


def test_a_4xx_fails_at_once_with_the_servers_message():
    with reward_server(lambda payload, n: (400, {"error": "label missing"}, 0.0)) as (url, rcvd):
        samples = [make_sample("yes")]
        report = score(url, samples, rm_max_retries=2)
    assert len(rcvd) == 1  # never retried
    assert report.failures == 1 and report.metrics()["reward/failure_rate"] == 1.0
    assert "HTTP 400" in samples[0].metadata["reward_error"]
    assert "label missing" in samples[0].metadata["reward_error"]


def test_a_server_slower_than_the_timeout_is_a_failure():
    with reward_server(lambda payload, n: (200, 1.0, 3.0)) as (url, _):
        report = score(url, [make_sample("yes")], rm_timeout_s=0.3)
    assert report.failures == 1 and "timed out" in report.failure_messages[0]


def test_an_unreachable_server_is_retried_then_a_failure():
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    report = score(f"http://127.0.0.1:{port}/score", [make_sample("yes")], rm_max_retries=1)
    assert report.failures == 1
    assert "no HTTP answer" in report.failure_messages[0]
    assert "after 2 attempts" in report.failure_messages[0]


def test_a_non_json_or_non_number_answer_is_a_failure():
    with reward_server(lambda payload, n: (200, "great", 0.0)) as (url, _):
        report = score(url, [make_sample("yes")])
    assert report.failures == 1 and "not a number" in report.failure_messages[0]


def test_group_rm_sends_one_list_per_group():
    with reward_server(correctness) as (url, received):
        samples = [
            make_sample("yes", group=0),
            make_sample("no", group=1),
            make_sample("no", group=0),
            make_sample("yes", group=1),
        ]
        report = score(url, samples, group_rm=True)
    assert report.rewards == [1.0, 0.0, 0.0, 1.0]
    assert sorted(len(p) for p in received) == [2, 2] and all(isinstance(p, list) for p in received)


def test_the_client_survives_a_fresh_event_loop_per_batch():
    # Trainers may call asyncio.run once per rollout: the pool is rebuilt for each loop.
    with reward_server(correctness) as (url, _):
        hub = RewardHub(RewardConfig(rm_type="remote", rm_url=url))
        for _ in range(2):
            assert asyncio.run(hub.score([make_sample("yes")])).rewards == [1.0]
        asyncio.run(hub.aclose())


@pytest.mark.parametrize("status", [404, 422])
def test_remote_model_raises_its_error_with_status_and_message(status):
    async def call(url: str) -> None:
        model = RemoteRewardModel(url, timeout_s=5, max_retries=3, max_connections=2)
        try:
            await model(make_sample("x"))
        finally:
            await model.aclose()

    with reward_server(lambda payload, n: (status, {"detail": "nope"}, 0.0)) as (url, rcvd):
        with pytest.raises(RuntimeError, match=f"HTTP {status}.*nope"):
            asyncio.run(call(url))
    assert len(rcvd) == 1
