"""Agent sessions: an agent's OpenAI calls through the session server become one token-exact
sample, sessions are bounded, and a failing agent fails its sample, not the rollout. Every test
drives a real reference engine with the real `openai` client."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from miles.backends.training_utils.batching.sample import Sample, SampleStatus
from miles.rollout.agent_function import load_agent
from miles.rollout.agent_rollout import AgentRunner, session_metrics
from miles.rollout.chat_template import ChatTemplate
from miles.rollout.engine_pool import EnginePool
from miles.rollout.session_server import SessionServer

QUESTION = [{"role": "user", "content": "Say something."}]
IDS = {"return_prompt_token_ids": True, "return_token_ids": True}


def run_agent(model_path: Path, url: str, agent, *, max_turns: int = 4, budget: int = 64,
              timeout_s: float = 60.0, seed: int = 0, temperature: float = 1.0,
              messages: list[dict] = QUESTION) -> Sample:  # fmt: skip
    """One sample made by `agent` over a session against the engine at `url`."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    params = {"temperature": temperature, "max_new_tokens": budget, "sampling_seed": seed,
              "no_stop_trim": True}  # fmt: skip

    async def main() -> Sample:
        server = await SessionServer().start()
        try:
            async with EnginePool([url]) as pool:
                runner = AgentRunner(agent, tokenizer, ChatTemplate(), server,
                                     max_turns=max_turns, timeout_s=timeout_s)  # fmt: skip
                sample = Sample(index=0, group_index=0, messages=list(messages), tokens=[1])
                return await runner.generate(pool, sample, params)
        finally:
            await server.aclose()

    return asyncio.run(main())


def _ids(choice) -> tuple[list[int], list[int]]:
    return choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]


# -- the token-exact rule -----------------------------------------------------------------------

Between = st.lists(
    st.tuples(st.sampled_from(["user", "tool"]), st.text("abc xyz.,!?0123456789", max_size=12)),
    min_size=1, max_size=2,
)  # fmt: skip


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    turns=st.lists(st.tuples(Between, st.integers(1, 5)), min_size=0, max_size=3),
    first_tokens=st.integers(1, 5),
    seed=st.integers(0, 1000),
)
def test_a_random_session_trains_exactly_the_engines_ids(
    tiny_checkpoint, engine_url, turns, first_tokens, seed
):
    """Whatever the turns, the sample's tokens are the last prompt the engine read followed by
    its last completion, each prompt extends the previous prompt and completion, and the loss
    mask is 1 on exactly the completions' ids, with the log-probs the engine gave them."""
    seen: list[tuple[list[int], list[int], list[float]]] = []

    async def agent(client: openai.AsyncOpenAI, sample: Sample) -> None:
        messages = list(sample.messages)
        plan = [([], first_tokens), *turns]
        for step, (between, max_tokens) in enumerate(plan):
            for k, (role, text) in enumerate(between):
                extra = {"tool_call_id": f"call_{step}_{k}"} if role == "tool" else {}
                messages.append({"role": role, "content": text, **extra})
            response = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=max_tokens, logprobs=True,
                extra_body=IDS,
            )  # fmt: skip
            choice = response.choices[0]
            prompt, completion = _ids(choice)
            seen.append((prompt, completion, [e.logprob for e in choice.logprobs.content]))
            messages.append(choice.message)  # echoed as the client returned it

    sample = run_agent(tiny_checkpoint, engine_url, agent, seed=seed, budget=200)
    assert sample.status != SampleStatus.FAILED, sample.metadata
    for (prompt, completion, _), (following, _, _) in itertools.pairwise(seen):
        assert following[: len(prompt) + len(completion)] == prompt + completion
    last_prompt, last_completion, _ = seen[-1]
    assert sample.tokens == last_prompt + last_completion
    first_prompt = seen[0][0]
    assert sample.tokens[: len(first_prompt)] == first_prompt
    assert sample.response_length == len(sample.tokens) - len(first_prompt)
    expected_mask = [0] * sample.response_length
    expected_lp: dict[int, float] = {}
    for prompt, completion, log_probs in seen:
        start = len(prompt) - len(first_prompt)
        assert len(log_probs) == len(completion)
        for i, lp in enumerate(log_probs):
            expected_mask[start + i] = 1
            expected_lp[start + i] = lp
    assert sample.loss_mask == expected_mask
    for position, lp in expected_lp.items():
        assert sample.rollout_log_probs[position] == pytest.approx(lp)
    assert sample.metadata["turns"] == len(seen) and sample.metadata["history_rewrites"] == 0


def test_a_rewritten_history_starts_a_new_trajectory_and_is_counted(tiny_checkpoint, engine_url):
    prompts = []

    async def agent(client, sample):
        first = await client.chat.completions.create(
            model="p", messages=sample.messages, max_tokens=3, extra_body=IDS
        )
        # Summarized history: the first answer is not echoed as it was.
        shorter = [*sample.messages, {"role": "assistant", "content": "summary"},
                   {"role": "user", "content": "go on"}]  # fmt: skip
        second = await client.chat.completions.create(
            model="p", messages=shorter, max_tokens=3, extra_body=IDS
        )
        prompts.extend([_ids(first.choices[0]), _ids(second.choices[0])])
        return "the answer"

    sample = run_agent(tiny_checkpoint, engine_url, agent)
    (_, _), (prompt, completion) = prompts
    assert sample.tokens == prompt + completion and sample.loss_mask == [1] * len(completion)
    assert sample.metadata["history_rewrites"] == 1 and sample.response == "the answer"


# -- bounds and failures ------------------------------------------------------------------------


async def _chat_until_refused(client, sample):
    messages = list(sample.messages)
    while True:
        response = await client.chat.completions.create(model="p", messages=messages, max_tokens=4)
        messages += [response.choices[0].message, {"role": "user", "content": "more"}]


def test_a_session_past_its_turns_is_truncated(tiny_checkpoint, engine_url):
    sample = run_agent(tiny_checkpoint, engine_url, _chat_until_refused, max_turns=2)
    assert sample.status == SampleStatus.TRUNCATED
    assert sample.metadata["session_end"] == "turn_limit" and sample.metadata["turns"] == 2
    assert "--max-turns" in sample.metadata["session_error"]  # what the agent was told
    assert sum(sample.loss_mask) > 0  # the turns it had are trained on


def test_a_session_past_its_tokens_is_truncated(tiny_checkpoint, engine_url):
    sample = run_agent(tiny_checkpoint, engine_url, _chat_until_refused, max_turns=50, budget=40)
    assert sample.status == SampleStatus.TRUNCATED
    assert sample.metadata["session_end"] == "token_limit"
    assert sample.response_length <= 40


def test_an_agent_that_raises_or_hangs_fails_its_sample_not_the_rollout(
    tiny_checkpoint, engine_url
):
    async def raises(client, sample):
        await client.chat.completions.create(model="p", messages=sample.messages, max_tokens=3)
        raise RuntimeError("the sandbox died")

    async def hangs(client, sample):
        await client.chat.completions.create(model="p", messages=sample.messages, max_tokens=3)
        await asyncio.sleep(60)

    async def raises_at_once(client, sample):
        raise KeyError("setup")

    failed = run_agent(tiny_checkpoint, engine_url, raises)
    assert failed.status == SampleStatus.FAILED and failed.metadata["session_end"] == "error"
    assert failed.metadata["session_error"] == "RuntimeError: the sandbox died"
    assert failed.response_length > 0 and failed.loss_mask == [0] * failed.response_length

    timed_out = run_agent(tiny_checkpoint, engine_url, hangs, timeout_s=2.0)
    assert timed_out.status == SampleStatus.FAILED
    assert timed_out.metadata["session_end"] == "timeout"
    assert set(timed_out.loss_mask) == {0}

    early = run_agent(tiny_checkpoint, engine_url, raises_at_once)
    assert early.status == SampleStatus.FAILED and early.response_length == 0
    metrics = session_metrics([failed, timed_out, early])
    assert metrics["rollout/session_end/error"] == 2.0
    assert metrics["rollout/session_end/timeout"] == 1.0


def test_an_agent_returning_something_else_than_text_is_told_so(tiny_checkpoint, engine_url):
    async def returns_a_number(client, sample):
        await client.chat.completions.create(model="p", messages=sample.messages, max_tokens=2)
        return 42

    sample = run_agent(tiny_checkpoint, engine_url, returns_a_number)
    assert sample.status == SampleStatus.FAILED
    assert "the agent returned a int" in sample.metadata["session_error"]


# -- the HTTP surface ---------------------------------------------------------------------------


def test_bad_requests_get_openai_errors_and_the_session_goes_on(tiny_checkpoint, engine_url):
    """Malformed bodies, unsupported fields and unknown sessions are 4xx in OpenAI's shape; the
    session still answers afterwards, and a streamed answer says what the plain one says."""
    found: dict = {}

    async def agent(client: openai.AsyncOpenAI, sample):
        base = str(client.base_url).rstrip("/")
        async with httpx.AsyncClient() as http:
            for body in ({"messages": []}, {"messages": sample.messages, "n": 2},
                         {"messages": sample.messages, "input_ids": [1, 2]},
                         {"messages": sample.messages, "frequency_penalty": 0.5},
                         {"messages": sample.messages, "chat_template_kwargs": {"x": 1}}):  # fmt: skip
                answer = await http.post(f"{base}/chat/completions", json=body)
                found.setdefault("errors", []).append((answer.status_code, answer.json()))
            raw = await http.post(f"{base}/chat/completions", content=b"{not json")
            found["raw"] = raw.status_code
            gone = await http.post(base.replace(base.split("/")[-2], "nope") + "/chat/completions",
                                   json={"messages": sample.messages})  # fmt: skip
            found["unknown"] = (gone.status_code, gone.json())
            found["models"] = (await http.get(f"{base}/models")).json()
        stream = await client.chat.completions.create(
            model="p", messages=sample.messages, max_tokens=4, stream=True,
            stream_options={"include_usage": True}, extra_body=IDS,
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        found["streamed"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        found["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        found["usage"] = chunks[-1].usage
        return found["streamed"]

    sample = run_agent(tiny_checkpoint, engine_url, agent)
    statuses = [status for status, _ in found["errors"]]
    assert statuses == [400] * 5 and found["raw"] == 400
    messages = [body["error"]["message"] for _, body in found["errors"]]
    assert "messages" in messages[0] and "n=2" in messages[1] and "input_ids" in messages[2]
    assert "not supported by a miles agent session" in messages[3]
    assert "--apply-chat-template-kwargs" in messages[4]
    assert (
        found["unknown"][0] == 404 and "no open session" in found["unknown"][1]["error"]["message"]
    )
    assert found["models"]["data"][0]["object"] == "model"
    # Only the streamed turn was a turn: the refused ones recorded nothing.
    assert sample.metadata["turns"] == 1 and sample.status != SampleStatus.FAILED
    assert sample.response == found["streamed"] and found["finish"] in ("stop", "length")
    assert found["usage"].completion_tokens == sum(sample.loss_mask)


def test_a_sessions_agent_can_be_loaded_only_when_async(tmp_path, monkeypatch):
    (tmp_path / "agents_here.py").write_text(
        "async def run(client, sample):\n    return None\n\ndef plain(client, sample):\n    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_agent("agents_here:run").__name__ == "run"
    with pytest.raises(ValueError, match="names a plain function"):
        load_agent("agents_here:plain")
    with pytest.raises(ValueError, match="--agent-function-path"):
        load_agent("agents_here:missing")


def test_the_session_server_refuses_an_address_it_cannot_listen_on():
    async def main():
        await SessionServer("203.0.113.7").start()  # TEST-NET-3: not this machine's

    with pytest.raises(OSError, match="--session-server-host"):
        asyncio.run(main())


def test_streamed_events_carry_tool_calls_as_deltas():
    from miles.rollout.session_server import _events

    answer = {"id": "c", "created": 1, "model": "m", "usage": {"total_tokens": 3},
              "choices": [{"index": 0, "finish_reason": "tool_calls", "matched_stop": None,
                           "logprobs": None, "message": {"role": "assistant", "content": "",
                           "tool_calls": [{"id": "1", "type": "function",
                                           "function": {"name": "f", "arguments": "{}"}}]}}]}  # fmt: skip

    async def collect():
        return [event async for event in _events(answer, include_usage=True)]

    events = asyncio.run(collect())
    assert events[-1] == b"data: [DONE]\n\n"
    decoded = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert decoded[1]["choices"][0]["delta"]["tool_calls"][0]["index"] == 0
    assert decoded[2]["choices"][0]["finish_reason"] == "tool_calls"
    assert decoded[3]["usage"] == {"total_tokens": 3}


# -- a whole rollout ----------------------------------------------------------------------------

AGENT_MODULE = """
def add(a: int, b: int) -> int:
    return a + b

async def two_turns(client, sample):
    first = await client.chat.completions.create(model="p", messages=sample.messages, max_tokens=3)
    messages = [*sample.messages, first.choices[0].message, {"role": "user", "content": "again"}]
    second = await client.chat.completions.create(model="p", messages=messages, max_tokens=3)
    sample.metadata["agent_saw"] = second.choices[0].message.content
    if sample.index % 4 == 3:
        raise RuntimeError("the fourth sandbox of each group breaks")
"""


def test_a_rollout_of_agent_sessions_from_the_runs_flags(
    tiny_checkpoint, engine_url, tmp_path, monkeypatch
):
    """--rollout-function-path miles.rollout.agent_rollout:AgentRollout with
    --agent-function-path: every sample is a session, failures are counted, nothing crashes."""
    from miles.config import load_config
    from miles.rollout.loader import load_rollout
    from miles.rollout.train_data import rollout_metrics
    from miles.utils.tokenizers import load_tokenizer
    from tests.support.rollout_context import rollout_context

    (tmp_path / "my_agent.py").write_text(AGENT_MODULE)
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config([
        "--hf-checkpoint", str(tiny_checkpoint), "--prompt-data", str(tmp_path / "data.jsonl"),
        "--input-key", "prompt", "--apply-chat-template", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "4", "--rollout-max-response-len", "32",
        "--rollout-function-path", "miles.rollout.agent_rollout:AgentRollout",
        "--agent-function-path", "my_agent:two_turns", "--max-turns", "3",
    ])  # fmt: skip

    class Prompts:
        served = 0

        def get_samples(self, num_prompts):
            groups = []
            for _ in range(num_prompts):
                g = self.served
                self.served += 1
                groups.append([Sample(index=g * 4 + i, group_index=g, messages=list(QUESTION),
                                      tokens=[1]) for i in range(4)])  # fmt: skip
            return groups

        def add_samples(self, groups):
            raise AssertionError("nothing is left over")

    async def score(groups):
        for sample in (s for group in groups for s in group):
            sample.reward = float(sample.status == SampleStatus.COMPLETED)

    async def main():
        async with EnginePool([engine_url]) as pool:
            ctx = rollout_context(
                pool, Prompts(), score, config.rollout, data=config.data,
                tokenizer=load_tokenizer(str(tiny_checkpoint)), model_path=str(tiny_checkpoint),
            )  # fmt: skip
            output = await load_rollout(config.rollout).generate_rollout(ctx, 0)
        from miles.rollout.agent_rollout import close_session_server

        await close_session_server()
        return output

    output = asyncio.run(main())
    samples = [s for group in output.groups for s in group]
    assert len(samples) == 8
    failed = [s for s in samples if s.status == SampleStatus.FAILED]
    assert [s.index % 4 for s in failed] == [3, 3]
    assert all(s.metadata["turns"] == 2 and "agent_saw" in s.metadata for s in samples)
    assert rollout_metrics(output.groups)["rollout/turns_mean"] == 2.0
    assert output.metrics["rollout/session_end/error"] == 2.0
    assert output.metrics["rollout/session_end/completed"] == 6.0


def test_agent_flags_are_checked_before_the_run(tmp_path, monkeypatch):
    from miles.config import load_config

    (tmp_path / "my_agent.py").write_text(AGENT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["--hf-checkpoint", "c", "--prompt-data", "d.jsonl", "--rollout-batch-size", "2"]
    with pytest.raises(
        ValueError, match=r"pass --rollout-function-path miles\.rollout\.agent_rollout"
    ):
        load_config([*base, "--agent-function-path", "my_agent:two_turns"])
    with pytest.raises(
        ValueError, match=r"pass --rollout-function-path miles\.rollout\.tool_rollout"
    ):
        load_config([*base, "--tool-paths", "my_agent:add"])
    agent_rollout = [
        "--rollout-function-path",
        "miles.rollout.agent_rollout:AgentRollout",
    ]
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        load_config([*base, *agent_rollout, "--agent-function-path", "my_agent:nope"])
    with pytest.raises(ValueError, match=r"--session-timeout-s \(0.0\) must be positive"):
        load_config([*base, "--session-timeout-s", "0"])


# -- on a real SGLang engine --------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and sglang")
def test_a_session_on_an_sglang_engine_is_token_exact(tiny_checkpoint):
    """The same rule on SGLang's own /generate: the sample is the engine's last prompt and
    completion, and the loss mask covers exactly its completions."""
    from miles.backends.sglang_utils.sglang_engine import SGLangEngine, SGLangEngineConfig
    from tests.support.distributed import free_port

    seen = []

    async def agent(client, sample):
        messages = list(sample.messages)
        for _ in range(3):
            response = await client.chat.completions.create(
                model="p", messages=messages, max_tokens=6, logprobs=True, extra_body=IDS
            )
            seen.append(_ids(response.choices[0]))
            messages += [response.choices[0].message, {"role": "user", "content": "and?"}]

    config = SGLangEngineConfig(model_path=str(tiny_checkpoint), port=free_port(),
                                mem_fraction_static=0.2, random_seed=0)  # fmt: skip
    with SGLangEngine(config) as engine:
        sample = run_agent(tiny_checkpoint, engine.url, agent, budget=200)
    assert sample.status != SampleStatus.FAILED, sample.metadata
    (first, _), (last_prompt, last_completion) = seen[0], seen[-1]
    assert sample.tokens == last_prompt + last_completion
    assert sum(sample.loss_mask) == sum(len(completion) for _, completion in seen)
    assert sample.tokens[: len(first)] == first


def test_sessions_asking_at_once_all_get_the_one_server_once_it_listens():
    """Every sample's session asks for the loop's session server on first use, concurrently:
    each must get the same server, already accepting connections."""
    from miles.rollout.agent_rollout import close_session_server, session_server

    async def ask_and_connect():
        server = await session_server("127.0.0.1", "p")
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)  # nothing refused
        writer.close()
        await writer.wait_closed()
        return server

    async def connect_at_once():
        servers = await asyncio.gather(*[ask_and_connect() for _ in range(8)])
        assert all(server is servers[0] for server in servers)
        await close_session_server()
        return servers[0]

    first = asyncio.run(connect_at_once())
    second = asyncio.run(connect_at_once())  # a new loop gets a server of its own
    assert first is not second


def test_a_vlm_session_reads_the_images_of_its_first_prompt(tmp_path):
    """An agent sends an image_url part through the real openai client: the prompt's image
    tokens come from the run's processor, every turn sends the image to the engine, the sample
    keeps it; a later message with a new image, or images for a text model, are refused."""
    import base64
    import io

    from PIL import Image
    from transformers import AutoProcessor

    from miles.backends.sglang_utils.image_data import image_bytes
    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint
    from miles.backends.sglang_utils.tiny_vlm import IMAGE_PAD_ID

    path = build_tiny_checkpoint(tmp_path / "vlm", architecture="qwen2_5_vl")
    tokenizer, processor = AutoTokenizer.from_pretrained(path), AutoProcessor.from_pretrained(path)
    buffer = io.BytesIO()
    Image.new("RGB", (84, 56), "blue").save(buffer, format="PNG")
    image = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    first = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                          {"type": "text", "text": "colour?"}]}]  # fmt: skip
    refusals: list[str] = []

    class Scripted:  # the engine: answers "blue", records what it was sent
        def __init__(self) -> None:
            self.payloads: list[dict] = []

        async def generate(self, payload: dict) -> dict:
            self.payloads.append(payload)
            ids = [*tokenizer.encode("blue", add_special_tokens=False), tokenizer.eos_token_id]
            meta = {"finish_reason": {"type": "stop"},
                    "output_token_logprobs": [[-0.1, i, None] for i in ids]}  # fmt: skip
            return {"text": "blue", "output_ids": ids, "meta_info": meta}

    async def agent(client: openai.AsyncOpenAI, sample):
        answer = await client.chat.completions.create(model="p", messages=first)
        history = [*first, {"role": "assistant", "content": answer.choices[0].message.content},
                   {"role": "user", "content": "sure?"}]  # fmt: skip
        again = await client.chat.completions.create(model="p", messages=history)
        history.append({"role": "assistant", "content": again.choices[0].message.content})
        part = {"type": "image_url", "image_url": {"url": image}}
        try:  # a new image after the first prompt
            await client.chat.completions.create(
                model="p", messages=[*history, {"role": "user", "content": [part]}]
            )
        except openai.BadRequestError as err:
            refusals.append(str(err))
        return None

    async def main(reads: object) -> Sample:
        server = await SessionServer().start()
        try:
            runner = AgentRunner(agent, tokenizer, ChatTemplate(), server, max_turns=4,
                                 timeout_s=60.0, processor=reads)  # fmt: skip
            sample = Sample(index=0, group_index=0, messages=first, tokens=[1])
            return await runner.generate(pool, sample, {"temperature": 1.0, "max_new_tokens": 64})
        finally:
            await server.aclose()

    pool = Scripted()
    sample = asyncio.run(main(processor))
    prompt = pool.payloads[0]["input_ids"]
    assert prompt.count(IMAGE_PAD_ID) == 6  # 84x56 pixels: 3x2 merged patches
    assert [p["image_data"] for p in pool.payloads] == [[image], [image]]
    assert image_bytes(sample.images[0]) == buffer.getvalue()
    assert sample.tokens[: len(prompt)] == prompt and sample.metadata["turns"] == 2
    assert sample.metadata["history_rewrites"] == 0
    assert "images may come only in a session's first messages" in refusals[0]

    refusals.clear()
    pool.payloads.clear()
    text_only = asyncio.run(main(None))  # a text model's run: the first request is refused
    assert pool.payloads == [] and text_only.status == SampleStatus.FAILED
    assert "need a vision-language model" in text_only.metadata["session_error"]
