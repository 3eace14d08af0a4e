"""/generate on a real reference-engine server: correctness of sampling, log-probs, batching,
streaming and SGLang's response format."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

PROMPTS = [[10, 20, 30], [5, 6, 7, 8, 9, 10, 11], [100], [64, 65, 66, 67]]


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()


def _generate(url, **body):
    response = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _argmax_continuation(model, prompt, steps):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _teacher_forced_logprobs(model, prompt, output, temperature=1.0):
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def test_greedy_equals_argmax_continuation_with_sglang_fields(engine_url, hf_model):
    result = _generate(
        engine_url,
        input_ids=PROMPTS[0],
        sampling_params={"temperature": 0, "max_new_tokens": 12},
        return_logprob=True,
    )
    assert result["output_ids"] == _argmax_continuation(hf_model, PROMPTS[0], 12)
    meta = result["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (3, 12)
    assert [entry[1] for entry in meta["output_token_logprobs"]] == result["output_ids"]
    assert isinstance(result["text"], str) and "weight_version" in meta


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_equal_teacher_forced_forward_of_temperature_scaled_model(
    engine_url, hf_model, temperature
):
    result = _generate(
        engine_url,
        input_ids=PROMPTS[1],
        return_logprob=True,
        sampling_params={"temperature": temperature, "max_new_tokens": 16, "seed": 3},
    )
    got = torch.tensor([entry[0] for entry in result["meta_info"]["output_token_logprobs"]])
    want = _teacher_forced_logprobs(hf_model, PROMPTS[1], result["output_ids"], temperature or 1.0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_top_logprobs_are_the_likeliest_tokens_of_the_teacher_forced_distribution(
    engine_url, hf_model
):
    result = _generate(
        engine_url,
        input_ids=PROMPTS[1],
        return_logprob=True,
        top_logprobs_num=4,
        sampling_params={"temperature": 0.7, "max_new_tokens": 6, "seed": 3},
    )
    ids = torch.tensor([PROMPTS[1] + result["output_ids"]])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(PROMPTS[1]) - 1 : -1] / 0.7
    want = torch.log_softmax(logits, -1).topk(4, dim=-1)
    tops = result["meta_info"]["output_top_logprobs"]
    assert len(tops) == len(result["output_ids"])
    assert [[entry[1] for entry in step] for step in tops] == want.indices.tolist()
    got = torch.tensor([[entry[0] for entry in step] for step in tops])
    torch.testing.assert_close(got, want.values, atol=1e-4, rtol=0)


def test_seeded_sampling_is_reproducible_and_seed_dependent(engine_url):
    params = {"temperature": 1.0, "max_new_tokens": 20, "seed": 1234}
    first = _generate(engine_url, input_ids=PROMPTS[3], sampling_params=params)["output_ids"]
    second = _generate(engine_url, input_ids=PROMPTS[3], sampling_params=params)["output_ids"]
    other = _generate(engine_url, input_ids=PROMPTS[3], sampling_params={**params, "seed": 99})[
        "output_ids"
    ]
    assert first == second
    assert first != other


def test_concurrent_requests_give_the_same_greedy_outputs_as_one_at_a_time(engine_url):
    def one(i):
        return _generate(
            engine_url,
            input_ids=PROMPTS[i],
            sampling_params={"temperature": 0, "max_new_tokens": 6 + 5 * i},
        )["output_ids"]

    alone = [one(i) for i in range(len(PROMPTS))]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        together = list(pool.map(one, list(range(len(PROMPTS))) * 2))
    assert together == alone * 2


def test_batch_request_with_n_expands_per_prompt_and_stops_on_stop_token(engine_url):
    results = _generate(
        engine_url,
        input_ids=PROMPTS[:2],
        sampling_params={"temperature": 1.0, "max_new_tokens": 5, "n": 3, "seed": 5},
    )
    assert len(results) == 6 and all(len(r["output_ids"]) <= 5 for r in results)
    greedy = _generate(
        engine_url, input_ids=PROMPTS[0], sampling_params={"temperature": 0, "max_new_tokens": 12}
    )
    stop_at = greedy["output_ids"][4]
    stopped = _generate(
        engine_url,
        input_ids=PROMPTS[0],
        sampling_params={"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [stop_at]},
    )
    index = greedy["output_ids"].index(stop_at)
    assert stopped["output_ids"] == greedy["output_ids"][: index + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


def test_text_prompt_and_stop_string_trim_the_text(engine_url):
    greedy = _generate(
        engine_url, text="abc", sampling_params={"temperature": 0, "max_new_tokens": 10}
    )
    text = greedy["text"]
    if len(text) < 3:
        pytest.skip(f"greedy text {text!r} too short to cut")
    stop = text[2]
    stopped = _generate(
        engine_url,
        text="abc",
        sampling_params={"temperature": 0, "max_new_tokens": 10, "stop": stop},
    )
    assert stopped["meta_info"]["finish_reason"]["type"] == "stop"
    assert stop not in stopped["text"] and text.startswith(stopped["text"])


def test_stream_sends_cumulative_events_then_done(engine_url):
    body = {
        "input_ids": PROMPTS[2],
        "sampling_params": {"temperature": 0, "max_new_tokens": 5},
        "stream": True,
    }
    events = []
    with httpx.stream("POST", f"{engine_url}/generate", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    items = [json.loads(e) for e in events[:-1]]
    assert [len(i["output_ids"]) for i in items] == sorted(len(i["output_ids"]) for i in items)
    final = _generate(
        engine_url, input_ids=PROMPTS[2], sampling_params={"temperature": 0, "max_new_tokens": 5}
    )
    assert items[-1]["output_ids"] == final["output_ids"]
    assert items[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_info_endpoints(engine_url, tiny_checkpoint):
    assert httpx.get(f"{engine_url}/health_generate", timeout=30).status_code == 200
    model_info = httpx.get(f"{engine_url}/get_model_info").json()
    assert model_info["model_path"] == str(tiny_checkpoint) and model_info["is_generation"] is True
    server_info = httpx.get(f"{engine_url}/get_server_info").json()
    assert server_info["max_running_requests"] == 128 and "weight_version" in server_info
