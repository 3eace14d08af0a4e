"""EnginePool: least-loaded balancing over real reference engines, abort and control broadcasts,
/generate through a real sglang-router, and with fault tolerance a lost engine's requests ended
at once while the others serve."""

from __future__ import annotations

import asyncio
import time
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.sglang_utils.client import EngineClient
from miles.backends.sglang_utils.router import running_router
from miles.rollout.engine_pool import EngineLostError, EnginePool, EngineUnavailableError


def long_request(max_new_tokens: int) -> dict:
    """A request that runs exactly `max_new_tokens` steps unless aborted."""
    return {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
        "return_logprob": True,
    }


async def engine_state(url: str) -> dict:
    async with EngineClient(url) as client:
        return (await client.get_server_info())["internal_states"][0]


async def wait_until_running(urls: list[str], count: int, timeout_s: float = 30.0) -> None:
    """Until the engines together decode `count` requests (all admitted, none still in transit)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = [await engine_state(url) for url in urls]
        if sum(state["num_running"] for state in states) == count:
            return
        assert time.monotonic() < deadline, f"engines never ran the requests: {states}"
        await asyncio.sleep(0.02)


def test_concurrent_requests_are_split_evenly_over_two_engines(engine_url, second_engine_url):
    urls = [engine_url, second_engine_url]

    async def run():
        before = [(await engine_state(url))["finished_requests"] for url in urls]
        async with EnginePool(urls) as pool:
            tasks, loads = [], []
            for _ in range(16):
                tasks.append(asyncio.create_task(pool.generate(long_request(32))))
                await asyncio.sleep(0)  # the new request picks its engine
                loads.append(pool.in_flight())
            results = await asyncio.gather(*tasks)
            assert pool.in_flight() == dict.fromkeys(urls, 0)
        after = [(await engine_state(url))["finished_requests"] for url in urls]
        return loads, results, [a - b for a, b in zip(after, before, strict=True)]

    loads, results, served = asyncio.run(run())
    assert all(max(load.values()) - min(load.values()) <= 1 for load in loads), loads
    assert loads[-1] == dict.fromkeys(urls, 8)
    assert served == [8, 8]
    assert all(len(result["output_ids"]) == 32 for result in results)


def test_abort_all_ends_requests_in_flight_on_every_engine(engine_url, second_engine_url):
    async def run():
        async with EnginePool([engine_url, second_engine_url]) as pool:
            tasks = [asyncio.create_task(pool.generate(long_request(1000))) for _ in range(4)]
            await wait_until_running([engine_url, second_engine_url], count=4)
            await pool.abort_all()
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
            return results, pool.in_flight()

    results, in_flight = asyncio.run(run())
    assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["abort"] * 4
    assert all(len(r["output_ids"]) < 1000 for r in results)
    assert all(
        len(r["meta_info"]["output_token_logprobs"]) == len(r["output_ids"]) for r in results
    )
    assert set(in_flight.values()) == {0}


def test_generate_goes_through_the_router_and_control_calls_reach_each_engine(
    engine_url, second_engine_url
):
    urls = [engine_url, second_engine_url]
    with running_router(urls) as router:

        async def run():
            async with EnginePool(urls, router_url=router.url) as pool:
                results = await asyncio.gather(*(pool.generate(long_request(4)) for _ in range(4)))
                assert list(pool.in_flight()) == [router.url]
                # The router answers 404 to pause: these only work if sent to the engines.
                await pool.pause_generation(mode="in_place")
                try:
                    paused = [(await engine_state(url))["paused"] for url in urls]
                finally:
                    await pool.continue_generation()
                resumed = [(await engine_state(url))["paused"] for url in urls]
                await pool.flush_cache()
                return results, paused, resumed

        results, paused, resumed = asyncio.run(run())
    assert all(len(r["output_ids"]) == 4 for r in results)
    assert all(r["meta_info"]["finish_reason"]["type"] == "length" for r in results)
    assert paused == [True, True]
    assert resumed == [False, False]


def test_memory_release_and_resume_reach_every_engine(engine_url, second_engine_url):
    urls = [engine_url, second_engine_url]

    async def health(url: str) -> bool:
        async with EngineClient(url) as client:
            return await client.health_generate()

    async def run():
        async with EnginePool(urls) as pool:
            await pool.release_memory_occupation()
            try:
                released = [await health(url) for url in urls]
            finally:
                await pool.resume_memory_occupation()
            resumed = [await health(url) for url in urls]
            answer = await pool.generate(long_request(2))
            return released, resumed, answer

    released, resumed, answer = asyncio.run(run())
    assert released == [False, False]
    assert resumed == [True, True]
    assert len(answer["output_ids"]) == 2


def test_a_refused_memory_release_raises_naming_the_engine(engine_url):
    # The reference engine refuses with HTTP 400 (EngineError); SGLang with `success: false`.
    async def run():
        async with EnginePool([engine_url]) as pool:
            running = asyncio.create_task(pool.generate(long_request(1000)))
            await wait_until_running([engine_url], count=1)
            try:
                with pytest.raises(
                    RuntimeError,
                    match=rf"release_memory_occupation.* {engine_url}.*requests are running",
                ):
                    await pool.release_memory_occupation()
            finally:
                await pool.abort_all()
                await running

    asyncio.run(run())


# -- balancing logic, with engines that answer when the test says so ---------------------------


class GatedEngines:
    """Stands in for EngineClient.generate: each call blocks until the test releases it."""

    def __init__(self):
        self.calls: list[tuple[str, asyncio.Event]] = []

    def patch(self):
        gated = self

        async def generate(client: EngineClient, payload: dict) -> dict:
            gate = asyncio.Event()
            gated.calls.append((client.url, gate))
            await gate.wait()
            return {"url": client.url}

        return patch.object(EngineClient, "generate", generate)


FAKE_URLS = [f"http://127.0.0.1:{port}" for port in (9, 10, 11, 12)]  # never contacted


@settings(max_examples=60, deadline=None)
@given(
    num_engines=st.integers(1, 4),
    steps=st.lists(st.one_of(st.none(), st.integers(0, 100)), max_size=40),
)
def test_every_request_goes_to_a_least_loaded_engine(num_engines, steps):
    """`None` starts a request; an int finishes one of those in flight (chosen by the int)."""

    async def replay():
        engines = GatedEngines()
        with engines.patch():
            pool = EnginePool(FAKE_URLS[:num_engines])
            running: list[tuple[asyncio.Task, asyncio.Event]] = []
            for step in steps:
                if step is None:
                    before = pool.in_flight()
                    task = asyncio.create_task(pool.generate({}))
                    await asyncio.sleep(0)  # runs the request up to its gate
                    url, gate = engines.calls[-1]
                    assert before[url] == min(before.values()), (before, url)
                    assert pool.in_flight()[url] == before[url] + 1
                    running.append((task, gate))
                elif running:
                    task, gate = running.pop(step % len(running))
                    gate.set()
                    await task
            for task, gate in running:
                gate.set()
                await task
            assert set(pool.in_flight().values()) == {0}
            await pool.aclose()

    asyncio.run(replay())


def test_equally_loaded_engines_take_turns():
    async def run():
        engines = GatedEngines()
        with engines.patch():
            async with EnginePool(FAKE_URLS[:3]) as pool:
                for _ in range(7):  # one at a time: every pick sees all engines idle
                    task = asyncio.create_task(pool.generate({}))
                    await asyncio.sleep(0)
                    engines.calls[-1][1].set()
                    await task
        return [url for url, _ in engines.calls]

    assert asyncio.run(run()) == [*FAKE_URLS[:3], *FAKE_URLS[:3], FAKE_URLS[0]]


def test_pool_needs_distinct_engine_urls():
    with pytest.raises(ValueError, match="at least one engine URL"):
        EnginePool([])
    with pytest.raises(ValueError, match="must be distinct"):
        EnginePool(["http://127.0.0.1:9", "http://127.0.0.1:9/"])


def test_a_lost_engine_ends_its_requests_at_once_and_new_ones_go_to_the_others(
    engine_url, second_engine_url
):
    async def run():
        async with EnginePool([engine_url, second_engine_url], fault_tolerant=True) as pool:
            first = asyncio.create_task(pool.generate(long_request(2000)))
            await asyncio.sleep(0)
            assert pool.in_flight() == {engine_url: 1, second_engine_url: 0}
            await wait_until_running([engine_url], count=1)
            lost_at = time.monotonic()
            pool.mark_lost(engine_url, "found dead by the test")
            with pytest.raises(EngineLostError, match="found dead by the test") as caught:
                await first
            ended_s = time.monotonic() - lost_at
            assert caught.value.url == engine_url
            answers = [await pool.generate(long_request(4)) for _ in range(3)]
            served = pool.serving()
            pool.admit(engine_url)
            tasks = [asyncio.create_task(pool.generate(long_request(4))) for _ in range(2)]
            await asyncio.sleep(0)
            balanced = pool.in_flight()
            await asyncio.gather(*tasks)
            await pool.abort_all()  # the engine still decodes the ended request: stop it
            return ended_s, answers, served, balanced, pool.reissued_requests

    ended_s, answers, served, balanced, reissued = asyncio.run(run())
    assert ended_s < 1.0
    assert all(len(a["output_ids"]) == 4 for a in answers)
    assert served == [second_engine_url]
    assert balanced == {engine_url: 1, second_engine_url: 1}
    assert reissued == 1


def test_while_no_engine_serves_a_request_waits_for_one_within_the_bound(engine_url):
    async def run():
        async with EnginePool([engine_url], fault_tolerant=True, timeout_s=1.0) as pool:
            pool.mark_lost(engine_url, "restarting")
            started = time.monotonic()
            with pytest.raises(EngineUnavailableError, match="no engine served for 1 s"):
                await pool.generate(long_request(2))
            waited_s = time.monotonic() - started
            waiting = asyncio.create_task(pool.generate(long_request(2)))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            pool.admit(engine_url)  # restarted, with the weights: the request goes out now
            return waited_s, await waiting

    waited_s, answer = asyncio.run(run())
    assert 1.0 <= waited_s < 2.0
    assert len(answer["output_ids"]) == 2


def test_a_pool_serving_an_adapter_names_it_in_every_request_that_names_none(engine_url):
    """The shared engine serves no adapters: it refuses a request naming one, which shows the
    pool put the name in; a request naming its own keeps it."""
    from miles.backends.sglang_utils.client import EngineError

    async def run() -> list[str]:
        errors = []
        async with EnginePool([engine_url], lora_name="miles-policy") as pool:
            for request in (long_request(1), {**long_request(1), "lora_path": "mine"}):
                with pytest.raises(EngineError) as refused:
                    await pool.generate(request)
                errors.append(str(refused.value))
        return errors

    pooled, own = asyncio.run(run())
    assert "miles-policy" in pooled and "mine" in own
