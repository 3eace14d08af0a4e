"""The reference engine's OpenAI-compatible routes, through the real `openai` client: chat and
text completions, streaming, log-probs, token ids, tool calls over two turns, and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint, teach

QUESTION = [{"role": "user", "content": "hello there"}]
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}


@pytest.fixture(scope="module")
def client(engine_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{engine_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def generate(engine_url: str, input_ids: list[int], **sampling) -> dict:
    body = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True}
    response = httpx.post(f"{engine_url}/generate", json=body, timeout=60)
    response.raise_for_status()
    return response.json()


def test_models_lists_the_served_model(client, tiny_checkpoint):
    (card,) = client.models.list().data
    assert card.id == str(tiny_checkpoint)
    assert card.model_extra["max_model_len"] == 1024


def test_a_chat_completion_is_the_engines_own_sample_of_the_templated_prompt(
    client, tokenizer, engine_url
):
    answer = client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=12, temperature=0.9, seed=5, n=2,
        logprobs=True, top_logprobs=3,
        extra_body={"return_prompt_token_ids": True, "return_token_ids": True},
    )  # fmt: skip
    rendered = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(rendered, add_special_tokens=False)
    assert answer.object == "chat.completion" and answer.model == "tiny"
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == sum(
        len(c.model_extra["token_ids"]) for c in answer.choices
    )
    for index, choice in enumerate(answer.choices):
        assert choice.index == index and choice.message.role == "assistant"
        assert choice.model_extra["prompt_token_ids"] == prompt
        ids = choice.model_extra["token_ids"]
        # The same draw through SGLang's native route: choice i is seeded seed + i.
        native = generate(
            engine_url, prompt, max_new_tokens=12, temperature=0.9, sampling_seed=5 + index
        )
        assert native["output_ids"] == ids
        assert choice.message.content == native["text"]
        logprobs = choice.logprobs.content
        assert [bytes(e.bytes) for e in logprobs] == [token_bytes(i) for i in ids]
        native_logprobs = [lp for lp, _, _ in native["meta_info"]["output_token_logprobs"]]
        assert [e.logprob for e in logprobs] == pytest.approx(native_logprobs, abs=1e-5)
        for entry in logprobs:
            tops = [t.logprob for t in entry.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True)
            assert entry.logprob <= tops[0] + 1e-6
    assert answer.choices[0].model_extra["token_ids"] != answer.choices[1].model_extra["token_ids"]
    assert answer.choices[0].finish_reason == "length"


def token_bytes(token_id: int) -> bytes:
    """The tiny tokenizer's spelling: ids 0-255 are bytes, then the special tokens."""
    specials = {256: b"<|endoftext|>", 257: b"<|im_start|>", 258: b"<|im_end|>"}
    return bytes([token_id]) if token_id < 256 else specials[token_id]


def test_token_bytes_are_exact_for_tokens_that_split_a_character(client):
    # A random model writes bytes >= 0x80: alone, their text is U+FFFD; their bytes are exact.
    answer = client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=40, temperature=1.0, seed=1, logprobs=True,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    ids = answer.choices[0].model_extra["token_ids"]
    entries = answer.choices[0].logprobs.content
    assert any(0x80 <= i < 256 for i in ids)
    assert [bytes(e.bytes) for e in entries] == [token_bytes(i) for i in ids]
    assert any(e.token == "\ufffd" for e in entries)


def test_a_stream_adds_up_to_the_same_completion(client):
    kwargs = {
        "model": "tiny",
        "messages": QUESTION,
        "max_tokens": 16,
        "seed": 3,
        "temperature": 0.8,
    }
    whole = client.chat.completions.create(**kwargs, logprobs=True)
    chunks = list(
        client.chat.completions.create(
            **kwargs, logprobs=True, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    streamed = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip
    assert streamed == pytest.approx([e.logprob for e in whole.choices[0].logprobs.content])
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_a_stop_string_ends_the_text_and_is_never_streamed(client):
    kwargs = {"model": "tiny", "prompt": "abc", "max_tokens": 24, "temperature": 0}
    free = client.completions.create(**kwargs).choices[0].text
    stop = free[4:6]
    assert len(stop) == 2
    stopped = client.completions.create(**kwargs, stop=[stop], logprobs=1).choices[0]
    assert stopped.text == free[: free.index(stop)] and stopped.finish_reason == "stop"
    chunks = list(client.completions.create(**kwargs, stop=stop, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == stopped.text
    # Held-back text does not shift the tokens' offsets.
    offsets = [
        o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert offsets == stopped.logprobs.text_offset


def test_a_request_id_lets_an_admin_abort_a_running_stream(client, engine_url):
    stream = client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=900, stream=True,
        extra_body={"rid": "long-answer", "ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))  # it runs
    assert httpx.post(f"{engine_url}/abort_request", json={"rid": "long-answer"}).status_code == 200
    finals = [
        c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["abort"]


def test_text_completions_of_text_and_token_prompts(client, tokenizer):
    answer = client.completions.create(
        model="tiny", prompt=["abc", "xyz"], max_tokens=6, n=2, seed=9, logprobs=2,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]  # prompt-major, n per prompt
    first = answer.choices[0]
    assert first.logprobs.tokens == [tokenizer.decode([i]) for i in first.model_extra["token_ids"]]
    assert len(first.logprobs.top_logprobs) == len(first.logprobs.token_logprobs)
    assert all(len(top) <= 2 for top in first.logprobs.top_logprobs)
    assert answer.usage.prompt_tokens == 6
    # Token ids and text prompts are the same prompt.
    by_ids = client.completions.create(
        model="tiny", prompt=tokenizer.encode("abc"), max_tokens=6, seed=9,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert by_ids.choices[0].text == first.text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="abc", max_tokens=6, seed=9, stream=True
        )
    )
    assert streamed == first.text


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
        ({"messages": QUESTION, "temperature": "hot"}, "temperature"),
        ({"messages": QUESTION, "n": 0}, "n"),
        ({"messages": QUESTION, "frequency_penalty": 0.5}, "frequency_penalty"),
        ({"messages": QUESTION, "top_logprobs": 2}, "top_logprobs needs logprobs"),
        ({"messages": QUESTION, "tools": [ADD_TOOL], "tool_choice": "required"}, "required"),
        ({"messages": QUESTION, "colour": "blue"}, "colour"),
        ({"messages": QUESTION, "max_tokens": 5000}, "context length"),
        ({"messages": QUESTION, "stop": ["ok", ""]}, "empty stop string"),
        (
            {"messages": QUESTION, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
            "chat_template",
        ),
        (
            {
                "messages": QUESTION,
                "tools": [{"type": "function", "function": {"name": "f", "strict": True}}],
            },
            "strict",
        ),
        ({"messages": QUESTION, "parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "surrogate"),
        ({"messages": QUESTION, "model": "m\ud800", "stream": True}, "surrogate"),
    ],
)
def test_a_malformed_request_is_a_400_naming_what_is_wrong(engine_url, body, names):
    # json.dumps writes a lone surrogate as the escape a client's JSON would carry ("\\ud800").
    payload = json.dumps({"model": "m", **body})
    response = httpx.post(f"{engine_url}/v1/chat/completions", content=payload, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert names in error["message"] + str(error["param"])


def test_the_client_sees_a_bad_request_error_and_the_server_stays_up(client, engine_url):
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="m", prompt="a", best_of=3)
    for body in (b"{not json", b"[" * 100_000 + b"]" * 100_000):
        bad = httpx.post(f"{engine_url}/v1/completions", content=body, timeout=30)
        assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    # None for an option is its default, as OpenAI's API takes it.
    nulls = client.chat.completions.create(
        model="m", messages=QUESTION, max_tokens=2, n=None, logprobs=None, stream=None
    )
    assert len(nulls.choices) == 1 and nulls.choices[0].logprobs is None
    assert (
        client.completions.create(model="m", prompt="a", max_tokens=2).choices[0].text is not None
    )


# -- tool calls, over two turns, with a model that learned them ---------------------------------

TOOL_TURN = 'Sure.\n<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
FINAL_TURN = "It is 5."
TOOL_QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


def _conversations() -> list[tuple[list[dict], str]]:
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    second = [*TOOL_QUESTION, {"role": "assistant", "content": "", "tool_calls": [call]},
              {"role": "tool", "content": "5"}]  # fmt: skip
    return [(TOOL_QUESTION, TOOL_TURN), (second, FINAL_TURN)]


@pytest.fixture(scope="module")
def tool_calling_checkpoint(tmp_path_factory) -> Path:
    """The tiny model, trained until it answers both turns of `_conversations` greedily."""
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("tool-model"), seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    examples = []
    for messages, answer in _conversations():
        rendered = tokenizer.apply_chat_template(
            messages, tools=[ADD_TOOL], add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer.encode(rendered, add_special_tokens=False)
        target = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
        examples.append((prompt + target, range(len(prompt), len(prompt) + len(target))))
    teach(path, examples)
    return path


def test_tool_calls_over_two_turns_with_the_openai_client(tool_calling_checkpoint, start_engine):
    with start_engine(tool_calling_checkpoint) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        messages = list(TOOL_QUESTION)
        first = client.chat.completions.create(
            model="tiny", messages=messages, tools=[ADD_TOOL], temperature=0, max_tokens=80
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
        (call,) = choice.message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {
            "a": 2,
            "b": 3,
        }
        streamed = list(client.chat.completions.create(
            model="tiny", messages=messages, tools=[ADD_TOOL], temperature=0, max_tokens=80,
            stream=True,
        ))  # fmt: skip
        # The tag's start and the whitespace before it are held back until the call is clear.
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == "Sure."
        (delta,) = [d for c in streamed for d in c.choices[0].delta.tool_calls or []]
        assert delta.index == 0 and delta.function.name == "add"
        assert streamed[-1].choices[0].finish_reason == "tool_calls"
        # Without tools the same output is plain text: nothing parses it.
        plain = client.chat.completions.create(
            model="tiny", messages=messages, tools=[ADD_TOOL], tool_choice="none", temperature=0,
            max_tokens=80,
        )  # fmt: skip
        assert plain.choices[0].message.tool_calls is None

        # The client sends the call back with its result: the template renders it as trained.
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "5"}]  # fmt: skip
        second = client.chat.completions.create(
            model="tiny", messages=messages, tools=[ADD_TOOL], temperature=0, max_tokens=80
        )
        assert second.choices[0].message.content == FINAL_TURN
        assert second.choices[0].finish_reason == "stop"
