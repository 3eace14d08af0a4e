"""The reference engine serving tiny Qwen2.5-VL and Qwen3-VL checkpoints: image prompts through
/generate (both prompt forms, every image source) and the real `openai` client score as a float64
Hugging Face forward of the processor's inputs does; text and image rows batch together, joining
a running batch; prompts share KV only with the same images; bad images are 400s naming them.

Tolerance: the engine computes in float32, the reference in float64; every log-prob agrees within
1e-5 (measured: under 1e-6).
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time

import openai
import pytest
import torch

from miles.backends.sglang_utils.client import EngineClient
from miles.backends.sglang_utils.reference_engine import ReferenceEngine, ReferenceEngineConfig
from miles.backends.sglang_utils.reference_engine.errors import InvalidRequestError
from miles.backends.sglang_utils.reference_engine.openai_protocol import (
    ChatCompletionBody,
    Server,
    validate,
)
from miles.backends.sglang_utils.tiny_vlm import IMAGE_PAD_ID

from .in_process_engine import serve_in_process
from .vision_support import (
    data_url,
    png_bytes,
    processor_inputs,
    reference_logprobs,
    shapes_image,
    user_turn,
)

ATOL = 1e-5
# Sampled (seeded), not greedy: a random tiny model's greedy answer repeats one token.
SAMPLING = {"max_new_tokens": 6, "temperature": 1.0, "seed": 3, "ignore_eos": True}


def generate(vlm, body: dict) -> dict | list[dict]:
    response = vlm.client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def request(inputs: dict, images: list, **fields) -> dict:
    """A /generate body: the processor's expanded ids and the images as data: URLs."""
    return {"input_ids": inputs["input_ids"][0].tolist(), "image_data": list(map(data_url, images)),
            "return_logprob": True, "sampling_params": SAMPLING, **fields}  # fmt: skip


def logprobs(item: dict, field: str = "output_token_logprobs") -> torch.Tensor:
    return torch.tensor([e[0] for e in item["meta_info"][field] if e[0] is not None]).double()


def test_image_prompt_log_probs_equal_a_float64_hf_forward_of_the_processors_inputs(vlm):
    image = shapes_image("red")
    inputs = processor_inputs(vlm, "how many circles?", [image])
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(IMAGE_PAD_ID) > 1
    body = request(inputs, [image], logprob_start_len=0)
    answer = generate(vlm, body)
    prompt_ref, output_ref = reference_logprobs(vlm.reference, inputs, answer["output_ids"])
    torch.testing.assert_close(logprobs(answer), output_ref, atol=ATOL, rtol=0)
    prompt_served = logprobs(answer, "input_token_logprobs")
    torch.testing.assert_close(prompt_served, prompt_ref, atol=ATOL, rtol=0)

    # Text with one placeholder per image: the engine's processor expands it to the same ids.
    text = vlm.processor.apply_chat_template(
        user_turn("how many circles?", 1), add_generation_prompt=True, tokenize=False
    )
    assert text.count("<|image_pad|>") == 1
    from_text = generate(vlm, {**body, "input_ids": None, "text": text})
    assert from_text["meta_info"]["prompt_tokens"] == len(ids)
    assert from_text["output_ids"] == answer["output_ids"]
    torch.testing.assert_close(logprobs(from_text), logprobs(answer), atol=0, rtol=0)


def test_raw_base64_and_a_local_path_read_the_same_image_as_a_data_url(vlm, tmp_path):
    image = shapes_image("green")
    body = request(processor_inputs(vlm, "which colour?", [image]), [])
    path = tmp_path / "green.png"
    path.write_bytes(png_bytes(image))
    sources = [data_url(image), base64.b64encode(png_bytes(image)).decode(), str(path)]
    answers = [generate(vlm, {**body, "image_data": source}) for source in sources]
    assert all(a["output_ids"] == answers[0]["output_ids"] for a in answers)
    assert all(torch.equal(logprobs(a), logprobs(answers[0])) for a in answers)


def test_the_openai_client_sends_image_url_parts_and_gets_the_hf_forwards_log_probs(vlm):
    image = shapes_image("blue", size=(60, 90))
    client = openai.OpenAI(base_url=f"{vlm.client.base_url}/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(
        model="tiny-vlm", max_tokens=5, temperature=1.0, seed=4, logprobs=True,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(image)}},
            {"type": "text", "text": "how many circles?"}]}],
        extra_body={"return_prompt_token_ids": True, "return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    (choice,) = answer.choices
    inputs = processor_inputs(vlm, "how many circles?", [image])
    assert choice.model_extra["prompt_token_ids"] == inputs["input_ids"][0].tolist()
    output_ids = choice.model_extra["token_ids"]
    served = torch.tensor([entry.logprob for entry in choice.logprobs.content]).double()
    _, expected = reference_logprobs(vlm.reference, inputs, output_ids)
    torch.testing.assert_close(served, expected, atol=ATOL, rtol=0)


def test_text_and_image_rows_decode_together_as_each_does_alone(vlm):
    red, blue = shapes_image("red"), shapes_image("blue", size=(112, 56))
    prompts = [
        (processor_inputs(vlm, "two images?", [red, blue]), [red, blue]),
        (processor_inputs(vlm, "just text, a longer prompt than the others", []), []),
        (processor_inputs(vlm, "one?", [blue]), [blue]),
    ]
    bodies = [request(inputs, images) for inputs, images in prompts]
    alone = [generate(vlm, body) for body in bodies]
    batch = {"input_ids": [b["input_ids"] for b in bodies],
             "image_data": [b["image_data"] for b in bodies]}  # fmt: skip
    batched = generate(vlm, {**bodies[0], **batch})
    for one, row, (inputs, _) in zip(alone, batched, prompts, strict=True):
        assert row["output_ids"] == one["output_ids"]
        torch.testing.assert_close(logprobs(row), logprobs(one), atol=ATOL, rtol=0)
        _, expected = reference_logprobs(vlm.reference, inputs, row["output_ids"])
        torch.testing.assert_close(logprobs(row), expected, atol=ATOL, rtol=0)


def test_image_requests_joining_a_running_batch_keep_their_own_positions(vlm):
    """A long request runs; two more (an image prompt, a text prompt) queue while the engine is
    paused, then join its batch: every row decodes at its own rope delta."""
    red, green = shapes_image("red"), shapes_image("green", size=(70, 112))
    long_inputs = processor_inputs(vlm, "describe", [red])
    join_inputs = processor_inputs(vlm, "and this?", [green])
    text_inputs = processor_inputs(vlm, "plain text", [])
    long_body = request(
        long_inputs, [red], stream=True, sampling_params={**SAMPLING, "max_new_tokens": 48}
    )
    joiners = [request(join_inputs, [green]), request(text_inputs, [])]
    results: list = [None] * len(joiners)
    with vlm.client.stream("POST", "/generate", json=long_body) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # it is decoding
        assert vlm.client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        assert vlm.engine.scheduler.num_running == 1, "the long request finished too early"

        def send(index: int) -> None:
            results[index] = generate(vlm, joiners[index])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(joiners))]
        for thread in threads:
            thread.start()
        while vlm.engine.scheduler.num_waiting < len(joiners):
            time.sleep(0.005)
        vlm.client.post("/continue_generation")
        for thread in threads:
            thread.join(timeout=60)
        *_, last = (line for line in lines if line.startswith("data:") and "[DONE]" not in line)
    long_answer = json.loads(last.removeprefix("data: "))
    assert long_answer["meta_info"]["completion_tokens"] == 48
    answers = [long_answer, *results]
    for answer, inputs in zip(answers, [long_inputs, join_inputs, text_inputs], strict=True):
        _, expected = reference_logprobs(vlm.reference, inputs, answer["output_ids"])
        torch.testing.assert_close(logprobs(answer), expected, atol=ATOL, rtol=0)


def test_prompts_with_the_same_ids_share_kv_only_with_the_same_images(vlm):
    red, blue = shapes_image("red"), shapes_image("blue")
    inputs = processor_inputs(vlm, "which colour?", [red])
    ids = inputs["input_ids"][0].tolist()
    assert ids == processor_inputs(vlm, "which colour?", [blue])["input_ids"][0].tolist()
    batch = generate(vlm, request(inputs, [], logprob_start_len=0, input_ids=[ids] * 3,
                                  image_data=[data_url(red), data_url(blue), data_url(red)]))  # fmt: skip
    assert [row["meta_info"]["cached_tokens"] for row in batch] == [0, 0, len(ids)]
    red_prompt, blue_prompt = (logprobs(row, "input_token_logprobs") for row in batch[:2])
    assert (red_prompt - blue_prompt).abs().max() > 1e-3  # the pixels reach the logits
    assert torch.equal(logprobs(batch[2], "input_token_logprobs"), red_prompt)
    blue_inputs = processor_inputs(vlm, "which colour?", [blue])
    expected, _ = reference_logprobs(vlm.reference, blue_inputs, [])
    torch.testing.assert_close(blue_prompt, expected, atol=ATOL, rtol=0)


def test_the_engine_client_passes_image_data_through(vlm):
    image = shapes_image("red")
    payload = request(processor_inputs(vlm, "hi", [image]), [image])

    async def through_client() -> dict:
        async with EngineClient(str(vlm.client.base_url)) as client:
            return await client.generate(payload)

    answer = asyncio.run(through_client())
    assert answer["output_ids"] == generate(vlm, payload)["output_ids"]


def _bad_requests(vlm, tmp_path) -> list[tuple[dict, str, str]]:
    """(body, param, words of the error) of each bad image request."""
    image = shapes_image("red")
    ids = processor_inputs(vlm, "hi", [image])["input_ids"][0].tolist()
    not_png = base64.b64encode(b"these bytes are no image").decode()
    truncated = base64.b64encode(png_bytes(image)[:60]).decode()
    return [
        ({"input_ids": ids, "image_data": f"data:image/png;base64,{not_png}"}, "image_data[0]",
         "do not decode as an image"),
        ({"input_ids": ids, "image_data": [truncated]}, "image_data[0]",
         "do not decode as an image"),
        ({"input_ids": ids, "image_data": ["not base64!"]}, "image_data[0]",
         "neither a data: URL nor base64"),
        ({"input_ids": ids, "image_data": ["https://example.com/cat.png"]}, "image_data[0]",
         "does not fetch images"),
        ({"input_ids": ids, "image_data": [str(tmp_path / "missing.png")]}, "image_data[0]",
         "no file at"),
        ({"input_ids": [ids, ids], "image_data": [[data_url(image)], "data:image/png,xyz"]},
         "image_data[1][0]", "data: URL without ';base64,'"),
        ({"input_ids": ids, "image_data": [data_url(image)] * 2}, "image_data",
         f"input_ids hold {ids.count(IMAGE_PAD_ID)} image tokens"),
        ({"input_ids": ids}, "image_data", "but the 0 image(s)"),
        ({"text": "<|image_pad|> and <|image_pad|>", "image_data": data_url(image)},
         "image_data", "2 <|image_pad|> placeholder(s) for 1 image(s)"),
    ]  # fmt: skip


def test_bad_images_are_400s_naming_the_image_and_the_fix(vlm, tmp_path):
    for body, param, words in _bad_requests(vlm, tmp_path):
        response = vlm.client.post("/generate", json={**body, "sampling_params": SAMPLING})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == param, (body, error)
        assert words in error["message"], error["message"]
    assert vlm.client.get("/health_generate").status_code == 200


def test_an_image_for_a_text_model_is_refused_naming_the_missing_vision_tower(tiny_checkpoint):
    image = data_url(shapes_image("red"))
    config = ReferenceEngineConfig(model_path=str(tiny_checkpoint), device="cpu")
    with serve_in_process(config) as (_, client):
        response = client.post("/generate", json={"input_ids": [1, 2], "image_data": image})
        assert response.status_code == 400
        assert "has no vision tower" in response.json()["error"]["message"]
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image}}]}]})  # fmt: skip
        assert chat.status_code == 400
        assert "messages gives 1 image(s)" in chat.json()["error"]["message"]
        assert client.get("/get_model_info").json()["has_image_understanding"] is False


def test_lora_serving_of_a_vlm_is_refused_at_start(vlm):
    config = ReferenceEngineConfig(model_path=str(vlm.path), device="cpu", enable_lora=True,
                                   max_lora_rank=8, lora_target_modules=["q_proj"])  # fmt: skip
    with pytest.raises(ValueError, match=r"--enable-lora: .* is a vision-language model"):
        ReferenceEngine(config)


def test_a_server_that_reads_no_images_refuses_image_url_parts():
    """A chat server that reads no images (`Server` without reads_images) shares the body and
    refuses image parts naming itself."""
    part = {"type": "image_url", "image_url": {"url": data_url(shapes_image("red"))}}
    body = {"messages": [{"role": "user", "content": [part]}]}
    assert validate(ChatCompletionBody, body).messages[0].image_urls == [part["image_url"]["url"]]
    with pytest.raises(InvalidRequestError, match="image_url content parts are not read by a s"):
        validate(ChatCompletionBody, body, Server("a session", "leave it unset"))
