"""Multi-turn rollouts with tools: the tool registry, calls that fail without failing the rollout,
and a whole two-turn exchange against a real engine with a model trained to call a tool."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint, teach
from miles.backends.training_utils.batching.sample import Sample, SampleStatus
from miles.rollout.chat_template import ChatTemplate
from miles.rollout.chat_turns import ChatTurns
from miles.rollout.engine_pool import EnginePool
from miles.rollout.tool_rollout import ToolAgent, agent_metrics
from miles.rollout.tools import call_tool, load_tools

from .conftest import running_engine


@pytest.fixture(autouse=True, scope="module")
def tool_functions_importable():
    # Module-scoped: the module's trained model imports the tools before any test runs.
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).parent))
        yield


def test_a_tools_spec_comes_from_its_name_docstring_and_signature():
    (tool,) = load_tools(["tool_fns:add"]).values()
    assert tool.spec == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        (["tool_fns:untyped"], "parameter 'x' needs one of the annotations"),
        (["tool_fns:add", "tool_fns:add"], "two tools are named 'add'"),
        (["tool_fns:nothing"], "--tool-paths"),
    ],
)
def test_an_unusable_tool_is_refused_naming_it(paths, message):
    with pytest.raises((ValueError, ImportError), match=message):
        load_tools(paths)


def test_a_failing_call_is_an_error_for_the_model_not_the_rollout():
    tools = load_tools(["tool_fns:add", "tool_fns:explode", "tool_fns:hang", "tool_fns:wait"])

    def call(name: str, arguments: dict | str) -> tuple[str, str | None]:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        result = asyncio.run(call_tool(tools, name, text, timeout_s=0.3))
        return result.text, result.failure

    assert call("add", {"a": 2, "b": 3}) == ("5", None)
    assert call("explode", {"reason": "no"}) == ("error: explode raised RuntimeError: no", "raised")
    assert call("hang", {"seconds": 2}) == ("error: hang did not answer within 0.3 s", "timeout")
    assert call("wait", {"seconds": 2}) == ("error: wait did not answer within 0.3 s", "timeout")
    assert call("add", {"a": 1})[1] == "bad arguments"  # b is missing
    assert call("add", "[1, 2]")[1] == "bad arguments"
    assert call("add", "{broken")[1] == "bad arguments"
    assert call("rm", {})[1] == "unknown tool"


# -- a whole exchange ---------------------------------------------------------------------------

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
ANSWER = "It is 5."


def _exchange(tokenizer, chat: ChatTurns) -> tuple[list[int], list[int], list[int], list[int]]:
    """The token-exact exchange the model is trained to produce: prompt, call, result, answer."""
    eos = tokenizer.eos_token_id
    prompt = chat.first(QUESTION)
    call = [*chat.encode(CALL), eos]
    result = chat.after(call, [{"role": "tool", "name": "add", "content": "5"}])
    answer = [*chat.encode(ANSWER), eos]
    return prompt, call, result, answer


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> Path:
    """The tiny model, trained until it makes both turns of the exchange greedily."""
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("tool-model"), seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    specs = [tool.spec for tool in load_tools(["tool_fns:add"]).values()]
    prompt, call, result, answer = _exchange(tokenizer, ChatTurns(tokenizer, ChatTemplate(), specs))
    whole = prompt + call + result + answer
    turn_two = len(prompt) + len(call) + len(result)
    teach(path, [(whole, range(len(prompt), len(prompt) + len(call))),
                 (whole, range(turn_two, len(whole)))])  # fmt: skip
    return path


@pytest.fixture(scope="module")
def tool_engine(tool_model):
    with running_engine(tool_model) as url:
        yield url


def _agent(tool_model) -> tuple[ToolAgent, ChatTurns]:
    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    tools = load_tools(["tool_fns:add"])
    agent = ToolAgent(tokenizer, ChatTemplate(), tools, max_turns=3, timeout_s=5.0)
    return agent, ChatTurns(tokenizer, ChatTemplate(), [t.spec for t in tools.values()])


def test_a_two_turn_exchange_is_one_token_exact_sample(tool_model, tool_engine):
    agent, chat = _agent(tool_model)
    prompt, call, result, answer = _exchange(agent.tokenizer, chat)

    async def run() -> Sample:
        async with EnginePool([tool_engine]) as pool:
            sample = Sample(index=0, group_index=0, messages=QUESTION, tokens=[1])
            return await agent.generate(pool, sample, {"temperature": 0.0, "max_new_tokens": 200})

    sample = asyncio.run(run())
    assert sample.status == SampleStatus.COMPLETED and sample.response == ANSWER
    assert sample.tokens == prompt + call + result + answer  # the engine's ids, nothing else
    assert sample.loss_mask == [1] * len(call) + [0] * len(result) + [1] * len(answer)
    assert len(sample.rollout_log_probs) == sample.response_length
    assert sample.metadata["turns"] == 2 and sample.metadata["tool_calls"] == 1
    assert sample.metadata["tool_failures"] == {}
    # A fresh rendering of the chat drops the <|endoftext|> the model wrote after its call: the
    # sample keeps it, and the turn is counted.
    assert sample.metadata["template_mismatches"] == 1


def test_the_same_exchange_through_an_agent_session_is_the_same_sample(tool_model, tool_engine):
    """An agent calling the tool through the OpenAI API of a session (tools offered, the call
    parsed into message.tool_calls, the result sent back as a tool message) trains on exactly
    the ids the built-in tool rollout does."""
    from .test_agent_session import run_agent

    agent, chat = _agent(tool_model)
    prompt, call, result, answer = _exchange(agent.tokenizer, chat)
    specs = [tool.spec for tool in agent.tools.values()]

    async def calls_add(client, sample):
        messages = list(sample.messages)
        first = await client.chat.completions.create(model="p", messages=messages, tools=specs)
        (tool_call,) = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "tool_calls"
        arguments = json.loads(tool_call.function.arguments)
        messages += [first.choices[0].message,
                     {"role": "tool", "name": "add", "tool_call_id": tool_call.id,
                      "content": str(arguments["a"] + arguments["b"])}]  # fmt: skip
        second = await client.chat.completions.create(model="p", messages=messages, tools=specs)
        return second.choices[0].message.content

    sample = run_agent(
        tool_model, tool_engine, calls_add, budget=200, temperature=0.0, messages=QUESTION
    )
    assert sample.response == ANSWER and sample.status == SampleStatus.COMPLETED
    assert sample.tokens == prompt + call + result + answer
    assert sample.loss_mask == [1] * len(call) + [0] * len(result) + [1] * len(answer)
    assert sample.metadata["template_mismatches"] == 1  # as in the tool rollout


def test_the_agent_of_the_sessions_guide_runs_as_written(tool_model, tool_engine, tmp_path):
    """The ~20-line agent of docs/guides/agent-sessions.md, run as written, makes the same
    sample the built-in tool rollout makes."""
    from .test_agent_session import run_agent

    guide = (Path(__file__).parents[3] / "docs/guides/agent-sessions.md").read_text()
    code = guide.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "my_agent.py", "exec"), namespace)
    agent, chat = _agent(tool_model)
    prompt, call, result, answer = _exchange(agent.tokenizer, chat)
    assert namespace["TOOLS"] == [tool.spec for tool in agent.tools.values()]
    sample = run_agent(tool_model, tool_engine, namespace["run"], budget=200, temperature=0.0,
                       messages=QUESTION)  # fmt: skip
    assert sample.response == ANSWER and sample.tokens == prompt + call + result + answer


class _Questions:
    """A data source of one repeated chat prompt."""

    def __init__(self, n_samples: int) -> None:
        self.n_samples, self.served = n_samples, 0

    def get_samples(self, num_prompts: int) -> list[list[Sample]]:
        groups = []
        for _ in range(num_prompts):
            group = self.served
            groups.append([Sample(index=group * self.n_samples + i, group_index=group,
                                  messages=QUESTION, tokens=[1]) for i in range(self.n_samples)])  # fmt: skip
            self.served += 1
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        raise AssertionError("nothing is left over in this rollout")


def test_a_rollout_of_tool_exchanges_is_scored_and_counted(tool_model, tool_engine):
    from miles.rollout.data_source import DataSourceConfig
    from miles.rollout.rollout_config import RolloutConfig
    from miles.rollout.tool_rollout import ToolRollout
    from miles.rollout.train_data import rollout_metrics
    from tests.support.rollout_context import rollout_context

    config = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2,
                           rollout_max_response_len=200, rollout_temperature=0.0,
                           tool_paths=["tool_fns:add"], max_turns=3, tool_timeout_s=5.0)  # fmt: skip
    data = DataSourceConfig(prompt_data="unread.jsonl", apply_chat_template=True)

    async def score(groups: list[list[Sample]]) -> None:
        for sample in (s for group in groups for s in group):
            sample.reward = float(sample.response == ANSWER)

    async def run():
        async with EnginePool([tool_engine]) as pool:
            ctx = rollout_context(pool, _Questions(2), score, config, data=data,
                                  tokenizer=AutoTokenizer.from_pretrained(tool_model))  # fmt: skip
            rollout = ToolRollout.from_config(config)
            rollout.check(config, data)
            return await rollout.generate_rollout(ctx, rollout_id=0)

    output = asyncio.run(run())
    samples = [s for group in output.groups for s in group]
    assert len(samples) == 4 and all(s.reward == 1.0 for s in samples)
    assert output.metrics == {**output.metrics, **agent_metrics(samples)}
    metrics = output.metrics
    assert rollout_metrics(output.groups)["rollout/turns_mean"] == 2.0
    assert metrics["rollout/tool_calls_mean"] == 1.0
    assert metrics["rollout/tool_failures/timeout"] == 0.0
    assert metrics["rollout/template_mismatches_mean"] == 1.0


class _ScriptedPool:
    """An engine pool that answers each /generate from a script (a dict, or an error to raise)."""

    def __init__(self, script: list) -> None:
        self.script, self.prompts, self.payloads = list(script), [], []

    async def generate(self, payload: dict) -> dict:
        self.prompts.append(payload["input_ids"])
        self.payloads.append(payload)
        answer = self.script.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def _answer(tokenizer, text: str, finish: str = "stop") -> dict:
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    meta = {"finish_reason": {"type": finish}, "weight_version": "3",
            "output_token_logprobs": [[-0.1, i, None] for i in ids]}  # fmt: skip
    return {"text": text, "output_ids": ids, "meta_info": meta}


def test_an_aborted_exchange_is_handed_back_to_start_again_and_a_refused_turn_truncates(
    tiny_checkpoint,
):
    from miles.backends.sglang_utils.client import EngineError

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    agent = ToolAgent(tokenizer, ChatTemplate(), load_tools(["tool_fns:add"]), max_turns=3,
                      timeout_s=5.0)  # fmt: skip
    params = {"temperature": 1.0, "max_new_tokens": 300, "sampling_seed": 7}

    def run(script: list) -> tuple[Sample, _ScriptedPool]:
        pool = _ScriptedPool(script)
        sample = Sample(index=0, group_index=0, messages=QUESTION, tokens=[1])
        return asyncio.run(agent.generate(pool, sample, params)), pool

    aborted, _ = run([_answer(tokenizer, CALL), _answer(tokenizer, "It i", finish="abort")])
    assert aborted.status == SampleStatus.ABORTED and aborted.response_length == 0
    assert aborted.rollout_log_probs is None and aborted.loss_mask is None  # ready to restart

    refused, pool = run([_answer(tokenizer, CALL), EngineError("u", "/generate", 400, "too long")])
    assert (
        refused.status == SampleStatus.TRUNCATED
        and "too long" in refused.metadata["engine_refusal"]
    )
    assert refused.weight_version == 3 and refused.metadata["tool_calls"] == 1
    assert refused.loss_mask[: len(pool.prompts[1]) - len(pool.prompts[0])].count(0) > 0  # result
    with pytest.raises(EngineError):  # the first prompt not fitting is the data's fault: loud
        run([EngineError("u", "/generate", 400, "prompt too long")])


def test_a_prompt_with_an_image_keeps_it_through_every_turn(tmp_path):
    """A VLM's tool exchange: the first prompt's image tokens come from the processor, and every
    turn sends the image again (its tokens stay in the ids)."""
    import base64
    import io

    from PIL import Image
    from transformers import AutoProcessor

    from miles.backends.sglang_utils.image_data import decode_image
    from miles.backends.sglang_utils.tiny_vlm import IMAGE_PAD_ID

    path = build_tiny_checkpoint(tmp_path, architecture="qwen2_5_vl")
    tokenizer, processor = AutoTokenizer.from_pretrained(path), AutoProcessor.from_pretrained(path)
    buffer = io.BytesIO()
    Image.new("RGB", (84, 56), "red").save(buffer, format="PNG")
    image = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    agent = ToolAgent(tokenizer, ChatTemplate(), load_tools(["tool_fns:add"]), max_turns=3,
                      timeout_s=5.0, processor=processor)  # fmt: skip
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "2+3?"}]}]
    sample = Sample(index=0, group_index=0, messages=messages, tokens=[1], images=[image])
    pool = _ScriptedPool([_answer(tokenizer, CALL), _answer(tokenizer, ANSWER)])
    done = asyncio.run(agent.generate(pool, sample, {"temperature": 1.0, "max_new_tokens": 300}))

    text = ChatTurns(tokenizer, ChatTemplate())._render(messages, generation_prompt=True)
    expanded = processor(text=[text], images=[decode_image(image)])["input_ids"][0]
    assert pool.prompts[0] == expanded and expanded.count(IMAGE_PAD_ID) == 6  # 84x56: 3x2 tokens
    assert [p["image_data"] for p in pool.payloads] == [[image], [image]]
    assert done.status == SampleStatus.COMPLETED and done.response == ANSWER
    assert done.tokens[: len(expanded)] == expanded and done.images == [image]
    assert done.metadata["tool_calls"] == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and sglang")
def test_a_tool_exchange_on_an_sglang_engine(tool_model):
    """The tool rollout on SGLang's own /generate: the trained model calls the tool and the
    sample is the exchange's ids, the tool result not trained on."""
    from miles.backends.sglang_utils.sglang_engine import SGLangEngine, SGLangEngineConfig
    from tests.support.distributed import free_port

    agent, chat = _agent(tool_model)
    prompt, call, result, _ = _exchange(agent.tokenizer, chat)
    config = SGLangEngineConfig(model_path=str(tool_model), port=free_port(), dtype="float32",
                                mem_fraction_static=0.2, random_seed=0)  # fmt: skip

    async def run() -> Sample:
        async with EnginePool([engine.url]) as pool:
            sample = Sample(index=0, group_index=0, messages=QUESTION, tokens=[1])
            return await agent.generate(pool, sample, {"temperature": 0.0, "max_new_tokens": 200})

    with SGLangEngine(config) as engine:
        sample = asyncio.run(run())
    assert sample.tokens[: len(prompt) + len(call) + len(result)] == prompt + call + result
    assert sample.metadata["tool_calls"] == 1 and 0 in sample.loss_mask
