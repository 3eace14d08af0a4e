"""The reference engine against hostile and careless clients, on loopback: every probe gets a JSON
4xx naming the field and its value, never a reset, and the engine serves correctly afterwards; a
request beside a bad one completes; clients that hang up stop their sequences; bodies, prompts,
sequences and the wait queue are bounded; admin routes take the admin key; refused weight updates
keep the old weights and version."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from miles.backends.sglang_utils.client import EngineClient
from miles.backends.sglang_utils.reference_engine.guard import ADMIN_ROUTES
from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

API_KEY, ADMIN_KEY = "inference-key", "admin-key"
GREEDY = {"input_ids": [72, 105], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}


def post(url: str, path: str, body=None, *, content: bytes | None = None, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if content is None:
        return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=60)


def greedy_ids(url: str, key: str | None = None) -> list[int]:
    answer = post(url, "/generate", GREEDY, key=key)
    assert answer.status_code == 200, answer.text
    return answer.json()["output_ids"]


def running(url: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    info = httpx.get(f"{url}/get_server_info", headers=headers, timeout=30).json()
    return info["internal_states"][0]["num_running"]


def long(tokens: int) -> dict:
    return {"input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}  # fmt: skip


PROBES = [
    # (body or raw bytes, the param named, words of the message)
    ({**GREEDY, "sampling_params": {"top_k": 2.5}}, "sampling_params.top_k", "valid integer"),
    ({**GREEDY, "sampling_params": {"stop": 5}}, "sampling_params.stop", "valid string"),
    ({**GREEDY, "sampling_params": {"stop": [1]}}, "sampling_params.stop", "valid string"),
    ({**GREEDY, "sampling_params": {"stop_token_ids": "abc"}}, "sampling_params.stop_token_ids",
     "valid list"),
    ({**GREEDY, "sampling_params": {"seed": "abc"}}, "sampling_params.seed", "valid integer"),
    ({**GREEDY, "sampling_params": {"seed": 2**70}}, "sampling_params.seed", "less than"),
    ({**GREEDY, "sampling_params": 5}, "sampling_params", "JSON object"),
    ({"input_ids": [[1, 2], 3]}, "input_ids[0]", "valid integer"),
    (b'{"text": "\xff\xfe"}', None, "not valid JSON"),
    # A lone UTF-16 surrogate, as an escape and as the bytes that encode it (json takes both).
    (b'{"text": "a\\ud800"}', None, "surrogate"),
    (b'{"text": "a\xed\xa0\x80"}', None, "surrogate"),
    (b"[1, 2]", None, "JSON object"),
    ({"text": "hi", "input_ids": [1]}, "text", "exactly one"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param", "words"), PROBES)
def test_a_malformed_generate_is_a_400_naming_the_field_and_the_engine_serves_on(
    engine_url, body, param, words
):
    before = greedy_ids(engine_url)
    raw = body if isinstance(body, bytes) else None
    with httpx.Client(timeout=30) as client:  # one pooled connection for both requests
        answer = client.post(f"{engine_url}/generate", json=None if raw else body, content=raw)
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["type"] == "invalid_request_error"
        assert error["param"] == param and words in error["message"], error
        # The connection was not reset: the next request on it is served.
        again = client.post(f"{engine_url}/generate", json=GREEDY)
    assert again.status_code == 200 and again.json()["output_ids"] == before


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/pause_generation", [1], None),
        ("/pause_generation", {"mode": "later"}, "mode"),
        ("/abort_request", {"rid": 7}, "rid"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29500,
         "rank_offset": 1, "world_size": 2, "group_name": "g", "backend": "mpi"}, "backend"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29500,
         "rank_offset": 0, "world_size": 2, "group_name": "g", "backend": "gloo"}, "rank_offset"),
        ("/update_weights_from_distributed", {"names": "w"}, "names"),
        ("/release_memory_occupation", {"tags": ["disk"]}, "tags[0]"),
    ],
)  # fmt: skip
def test_a_malformed_control_body_is_a_400_naming_the_field(engine_url, path, body, param):
    answer = post(engine_url, path, body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert greedy_ids(engine_url)  # still serving, not paused


def test_a_request_beside_a_bad_one_completes_normally(engine_url):
    async def run():
        async with httpx.AsyncClient(base_url=engine_url, timeout=60) as client:
            victim = asyncio.create_task(client.post("/generate", json=long(40)))
            await asyncio.sleep(0.2)
            bad = await client.post("/generate", json={**GREEDY, "sampling_params": {"top_k": 2.5}})
            return bad, await victim

    bad, victim = asyncio.run(run())
    assert bad.status_code == 400
    meta = victim.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 40


def test_clients_that_hang_up_stop_their_sequences_within_a_second(engine_url):
    async def hang_up(client: httpx.AsyncClient, stream: bool) -> None:
        if stream:  # the first event, then the client closes the connection
            async with client.stream(
                "POST", "/generate", json={**long(2000), "stream": True}
            ) as response:
                async for _ in response.aiter_bytes():
                    break
        else:  # gives up waiting for the answer after 0.05 s
            with pytest.raises(httpx.TimeoutException):
                await client.post("/generate", json=long(2000), timeout=0.05)

    async def run():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=engine_url, limits=limits) as client:
            await asyncio.gather(*(hang_up(client, stream=i % 4 == 0) for i in range(100)))

    asyncio.run(run())
    gone = time.monotonic()
    while running(engine_url) > 0:
        assert time.monotonic() - gone < 1.0, f"{running(engine_url)} sequences still decode"
        time.sleep(0.02)
    assert greedy_ids(engine_url)


def test_a_long_prompt_is_refused_before_tokenizing_and_health_stays_quick(engine_url):
    text = "x" * (4 << 20)  # 4 MB
    health_s: list[float] = []

    def probe_health() -> None:
        for _ in range(10):
            start = time.monotonic()
            assert httpx.get(f"{engine_url}/health", timeout=10).status_code == 200
            health_s.append(time.monotonic() - start)
            time.sleep(0.05)

    prober = threading.Thread(target=probe_health)
    prober.start()
    answer = post(engine_url, "/generate", {"text": text})
    prober.join()
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "text"
    assert "characters" in answer.json()["error"]["message"]
    assert max(health_s) < 2.0, health_s  # it stalled 5.4 s while the prompt was tokenized


def test_too_many_sequences_in_one_request_is_a_400(engine_url):
    body = {"input_ids": [[1, 2]] * 64, "sampling_params": {"n": 100, "max_new_tokens": 1}}
    answer = post(engine_url, "/generate", body)
    assert answer.status_code == 400 and "6400 sequences" in answer.json()["error"]["message"]


@pytest.fixture(scope="module")
def locked_engine(start_engine, tiny_checkpoint):
    """An engine with both keys, 2 decode slots and room for 3 waiting sequences."""
    with start_engine(
        tiny_checkpoint, "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY,
        "--max-running-requests", "2", "--max-queued-requests", "3",
        "--max-request-bytes", "100000",
    ) as url:  # fmt: skip
        yield url


def test_admin_routes_take_the_admin_key_and_inference_routes_either_key(locked_engine):
    url = locked_engine
    for path in sorted(ADMIN_ROUTES):
        statuses = [post(url, path, {}, key=key).status_code for key in (None, API_KEY)]
        assert statuses == [401, 401], (path, statuses)
        assert post(url, path, {}, key=ADMIN_KEY).status_code != 401, path
        post(url, "/continue_generation", key=ADMIN_KEY)  # undo a pause
    assert post(url, "/generate", GREEDY).status_code == 401
    assert greedy_ids(url, API_KEY) == greedy_ids(url, ADMIN_KEY)
    assert httpx.get(f"{url}/health").status_code == 200  # probes stay open
    info = httpx.get(f"{url}/get_server_info", headers={"Authorization": f"Bearer {API_KEY}"})
    assert API_KEY not in info.text and ADMIN_KEY not in info.text
    assert info.json()["api_key"] == "(set)"


def test_a_body_over_the_limit_is_a_413(locked_engine):
    answer = post(locked_engine, "/generate", {"input_ids": [1] * 60_000}, key=API_KEY)
    assert answer.status_code == 413, answer.text


async def running_and_waiting(client: httpx.AsyncClient) -> tuple[int, int]:
    state = (await client.get("/get_server_info")).json()["internal_states"][0]
    return state["num_running"], state["num_waiting"]


def test_a_full_queue_answers_503_with_retry_after_and_the_client_waits_its_turn(locked_engine):
    url = locked_engine

    async def run():
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with httpx.AsyncClient(base_url=url, headers=admin, timeout=60) as raw:
            # Paused, the engine admits nothing: three requests fill the wait queue exactly.
            await raw.post("/pause_generation", json={"mode": "in_place"})
            busy = [asyncio.create_task(raw.post("/generate", json=long(1000))) for _ in range(3)]
            deadline = time.monotonic() + 30
            while await running_and_waiting(raw) != (0, 3):
                assert time.monotonic() < deadline, await running_and_waiting(raw)
                await asyncio.sleep(0.02)
            refused = await raw.post("/generate", json=long(1))
            async with EngineClient(url, api_key=API_KEY, backoff_s=0.05) as client:
                waiting = asyncio.create_task(client.generate(long(1)))
                await asyncio.sleep(0.3)  # refused once, now waiting for the Retry-After
                await raw.post("/abort_request", json={"abort_all": True})
                await raw.post("/continue_generation")
                served = await waiting
            await asyncio.gather(*busy)
            return refused, served

    refused, served = asyncio.run(run())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "--max-queued-requests 3" in refused.json()["error"]["message"]
    assert served["meta_info"]["completion_tokens"] == 1


def _state(url: str) -> tuple[list[int], str]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    version = httpx.get(f"{url}/get_model_info", headers=headers).json()["weight_version"]
    return greedy_ids(url, ADMIN_KEY), version


def test_a_bad_checkpoint_is_refused_keeping_the_weights_and_the_version(
    locked_engine, tiny_checkpoint, tmp_path
):
    url = locked_engine
    before = _state(url)
    (weights_file,) = Path(tiny_checkpoint).glob("*.safetensors")
    tensors = load_file(weights_file)
    partial = tmp_path / "partial"
    partial.mkdir()
    save_file(
        {k: v for k, v in tensors.items() if "layers.0.mlp" not in k}, partial / "m.safetensors"
    )
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "m.safetensors").write_bytes(weights_file.read_bytes()[:1000])
    nonfinite = tmp_path / "nan"
    nonfinite.mkdir()
    save_file({k: v.fill_(float("nan")) if "norm" in k else v for k, v in tensors.items()},
              nonfinite / "m.safetensors")  # fmt: skip
    wider = build_tiny_checkpoint(tmp_path / "wider", seed=0, intermediate_size=96)
    cases = {
        str(tmp_path / "missing"): "no *.safetensors",
        str(partial): "is missing",
        str(corrupt): "cannot read",
        str(nonfinite): "NaN or infinite",
        str(wider): "has shape",
    }
    for path, words in cases.items():
        answer = post(url, "/update_weights_from_disk", {"model_path": path, "weight_version": "9"},
                      key=ADMIN_KEY)  # fmt: skip
        assert answer.status_code == 400 and answer.json()["success"] is False, answer.text
        assert words in answer.json()["message"], (path, answer.json())
        assert _state(url) == before, path
    loaded = post(url, "/update_weights_from_disk",
                  {"model_path": str(tiny_checkpoint), "weight_version": "9"}, key=ADMIN_KEY)  # fmt: skip
    assert loaded.json()["success"] is True
    assert _state(url) == (before[0], "9")  # the same weights again, the new version
