"""Bad input gets a 400 and the engine keeps serving; abort and pause behave as SGLang's."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

LONG = {
    "input_ids": [1, 2, 3],
    "sampling_params": {"temperature": 1.0, "max_new_tokens": 100000, "ignore_eos": True},
}


def _post(url, path, **kwargs):
    return httpx.post(f"{url}{path}", timeout=60, **kwargs)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "the body is not valid JSON"),
        (
            b'{"input_ids": [1, 2], "sampling_params": {"top_p": 1.5}}',
            "sampling_params.top_p: Input should be less than or equal to 1 (got 1.5)",
        ),
        (b'{"input_ids": [1, 2], "text": "x"}', "give exactly one of 'text' or 'input_ids'"),
        (b'{"input_ids": [1, 99999]}', "token id 99999 >= vocab size"),
        (
            b'{"input_ids": [1], "lora_path": "adapter"}',
            "LoRA adapter 'adapter' was requested (lora_path), but LoRA is not enabled",
        ),
        (b'{"input_ids": [1], "bogus_field": 1}', "unknown /generate field 'bogus_field'"),
    ],
)
def test_bad_generate_requests_get_400_with_the_reason_and_the_engine_keeps_serving(
    engine_url, body, message
):
    response = _post(
        engine_url, "/generate", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]
    ok = _post(
        engine_url,
        "/generate",
        json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
    )
    assert ok.status_code == 200


def test_prompt_longer_than_context_is_rejected(engine_url):
    response = _post(engine_url, "/generate", json={"input_ids": [1] * 2000})
    assert response.status_code == 400
    assert "does not fit the context length 1024" in response.json()["error"]["message"]


def test_sglang_router_style_fields_at_defaults_are_accepted(engine_url):
    body = {
        "input_ids": [4, 5],
        "sampling_params": {"max_new_tokens": 2},
        "return_hidden_states": False,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "log_metrics": True,
        "routed_dp_rank": None,
        "stream": False,
        "return_text_in_logprobs": False,
        "lora_path": None,
    }
    assert _post(engine_url, "/generate", json=body).status_code == 200


def test_mutating_routes_refuse_get(engine_url):
    assert httpx.get(f"{engine_url}/flush_cache").status_code == 405
    assert httpx.get(f"{engine_url}/update_weights_from_tensor").status_code == 405


def _in_background(url, body, results):
    thread = threading.Thread(
        target=lambda: results.append(_post(url, "/generate", json=body).json())
    )
    thread.start()
    return thread


def _wait_running(url, count=1, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/get_server_info").json()["internal_states"][0]["num_running"] >= count:
            return
        time.sleep(0.05)
    raise TimeoutError("request never started running")


def test_abort_request_by_rid_finishes_it_with_abort(engine_url):
    results: list = []
    thread = _in_background(engine_url, {**LONG, "rid": "victim"}, results)
    _wait_running(engine_url)
    assert _post(engine_url, "/abort_request", json={"rid": "victim"}).status_code == 200
    thread.join(30)
    assert results[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert results[0]["meta_info"]["id"] == "victim"


def test_pause_abort_mode_aborts_in_flight_and_holds_new_requests_until_continue(engine_url):
    results: list = []
    thread = _in_background(engine_url, LONG, results)
    _wait_running(engine_url)
    assert _post(engine_url, "/pause_generation", json={"mode": "abort"}).json()["success"]
    thread.join(30)
    assert results[0]["meta_info"]["finish_reason"]["type"] == "abort"
    held: list = []
    waiting = _in_background(
        engine_url, {"input_ids": [7, 8], "sampling_params": {"max_new_tokens": 3}}, held
    )
    time.sleep(0.5)
    assert not held, "a request finished while generation was paused"
    _post(engine_url, "/continue_generation")
    waiting.join(30)
    assert held[0]["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_in_place_keeps_the_sequence_and_it_completes_after_continue(engine_url):
    body = {
        "input_ids": [9, 9, 9],
        "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True},
    }
    expected = _post(engine_url, "/generate", json=body).json()["output_ids"]
    results: list = []
    thread = _in_background(engine_url, body, results)
    _wait_running(engine_url)
    _post(engine_url, "/pause_generation", json={"mode": "in_place"})
    time.sleep(0.3)
    _post(engine_url, "/continue_generation")
    thread.join(30)
    assert results[0]["output_ids"] == expected


def test_api_key_is_required_on_every_route_when_set(start_engine, tiny_checkpoint):
    with start_engine(tiny_checkpoint, "--api-key", "s3cret") as url:
        assert httpx.get(f"{url}/get_model_info").status_code == 401
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        assert _post(url, "/generate", json=body).status_code == 401
        headers = {"Authorization": "Bearer s3cret"}
        assert _post(url, "/generate", json=body, headers=headers).status_code == 200
