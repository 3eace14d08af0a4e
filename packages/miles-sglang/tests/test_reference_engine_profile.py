"""The engine's own profiler, as SGLang serves it: /start_profile, requests, /stop_profile leave a
gzipped Chrome trace of the engine loop's ops where the caller said."""

from __future__ import annotations

import asyncio
import gzip
import json

import httpx

from miles.backends.sglang_utils.engine_client import EngineClient


def test_a_profile_between_start_and_stop_traces_the_generation_it_saw(engine_url, tmp_path):
    async def profile() -> tuple[dict, dict, dict]:
        async with EngineClient(engine_url) as client:
            started = await client.start_profile(str(tmp_path), activities=["CPU"])
            again = await client.start_profile(str(tmp_path))
            await client.generate(
                {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
            )
            return started, again, await client.stop_profile()

    started, again, stopped = asyncio.run(profile())
    assert started["success"] and not again["success"]
    assert "already running" in again["message"]
    (trace,) = tmp_path.glob("*-TP-0.trace.json.gz")
    assert str(trace) in stopped["message"]
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {event.get("name") for event in events}
    assert any(str(name).startswith("aten::") for name in names)  # the model's forward ran


def test_stop_without_a_profile_and_step_counted_profiles_are_refused_by_name(engine_url):
    stop = httpx.post(f"{engine_url}/stop_profile", timeout=30)
    assert stop.status_code == 400 and "no profile is running" in stop.json()["message"]
    steps = httpx.post(f"{engine_url}/start_profile", json={"num_steps": 5}, timeout=30)
    assert steps.status_code == 400 and "num_steps" in steps.text
