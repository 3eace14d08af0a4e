"""Evaluation makes held-out samples as the run's rollout makes its own: the tool rollout's
multi-turn episodes (also for a supervised warm-up with --tool-paths), or the custom generate
function; and a warm-up's prompts show the tools as the tool rollout's do."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from miles.backends.training_utils.batching.sample import Sample
from miles.config import load_config
from miles.ray.rollout_manager import RolloutManager
from miles.rollout.loader import load_rollout
from miles.rollout.sft_rollout import SftRollout
from miles.rollout.single_turn import SingleTurnRollout
from miles.rollout.tool_rollout import ToolAgent, ToolRollout
from miles.utils.tokenizers import load_tokenizer
from tests.support.rollout_context import rollout_context

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
QUESTION = "What is 2 + 3?"
ANSWER = "It is 5."


@pytest.fixture(autouse=True)
def test_functions_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text(json.dumps({"input": QUESTION, "label": ANSWER}) + "\n")
    return path


def _config(tiny_checkpoint, data_file, tmp_path, *flags: str):
    return load_config([
        "--hf-checkpoint", str(tiny_checkpoint), "--prompt-data", str(data_file),
        "--rollout-batch-size", "1", "--rm-type", "exact_match", "--rollout-max-response-len", "200",
        "--eval-prompt-data", "heldout", str(data_file), "--n-samples-per-eval-prompt", "2",
        "--output-dir", str(tmp_path / "run"), *flags,
    ])  # fmt: skip


TOOL_FLAGS = ("--apply-chat-template", "--tool-paths", "tool_fns:add")


class _ScriptedPool:
    """An engine pool that answers `first` to a question and `after_tool` to a tool's result."""

    fault_tolerant, router_url = False, None

    def __init__(self, tokenizer, first: str, after_tool: str) -> None:
        self.tokenizer, self.first, self.after_tool, self.prompts = tokenizer, first, after_tool, []

    async def generate(self, payload: dict) -> dict:
        self.prompts.append(payload["input_ids"])
        if isinstance(payload["input_ids"][0], list):  # a batched request: one answer each
            return [self._answer(self.first) for _ in payload["input_ids"]]
        prompt = self.tokenizer.decode(payload["input_ids"])
        return self._answer(self.after_tool if "<|im_start|>tool" in prompt else self.first)

    def _answer(self, text: str) -> dict:
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        meta = {"finish_reason": {"type": "stop"},
                "output_token_logprobs": [[-0.1, i, None] for i in ids]}  # fmt: skip
        return {"text": text, "output_ids": ids, "meta_info": meta}

    async def abort_all(self) -> None:
        pass


def _evaluate(config, first: str, after_tool: str = "") -> tuple[dict[str, float], _ScriptedPool]:
    manager = RolloutManager(config, None, dp_size=1)
    tokenizer = AutoTokenizer.from_pretrained(config.checkpoint.hf_checkpoint)
    pool = _ScriptedPool(tokenizer, first, after_tool)

    async def run() -> dict[str, float]:
        await manager.load_data()
        manager.engines.pool = pool
        return await manager.eval(0)

    return asyncio.run(run()), pool


def test_a_tool_rollout_is_evaluated_over_its_multi_turn_episodes(
    tiny_checkpoint, data_file, tmp_path
):
    config = _config(tiny_checkpoint, data_file, tmp_path, *TOOL_FLAGS,
                     "--rollout-function-path", "miles.rollout.tool_rollout:ToolRollout")  # fmt: skip
    metrics, pool = _evaluate(config, CALL, ANSWER)
    # Each held-out sample called the tool, read its result and answered: two engine turns.
    assert len(pool.prompts) == 2 * 2
    assert metrics["eval/heldout/reward_mean"] == 1.0


def test_a_warm_up_with_tools_is_evaluated_over_the_tool_rollouts_episodes(
    tiny_checkpoint, data_file, tmp_path
):
    config = _config(tiny_checkpoint, data_file, tmp_path, *TOOL_FLAGS,
                     "--rollout-function-path", "miles.rollout.sft_rollout:SftRollout",
                     "--loss-type", "sft_loss")  # fmt: skip
    metrics, pool = _evaluate(config, CALL, ANSWER)
    assert len(pool.prompts) == 2 * 2 and metrics["eval/heldout/reward_mean"] == 1.0


def test_a_single_turn_run_is_evaluated_with_one_call_per_sample(
    tiny_checkpoint, data_file, tmp_path
):
    config = _config(tiny_checkpoint, data_file, tmp_path)
    metrics, pool = _evaluate(config, ANSWER)
    assert len(pool.prompts) == 1  # one batched request for the group of two
    assert metrics["eval/heldout/reward_mean"] == 1.0


def test_evaluation_uses_the_custom_generate_function(tiny_checkpoint, data_file, tmp_path):
    rows = tmp_path / "abc.jsonl"
    rows.write_text(json.dumps({"input": QUESTION, "label": "ABC"}) + "\n")
    config = _config(tiny_checkpoint, rows, tmp_path,
                     "--custom-generate-function-path", "custom_rollout_fns:canned_generate")  # fmt: skip
    metrics, pool = _evaluate(config, ANSWER)
    assert pool.prompts == []  # canned_generate answers without the engine
    assert metrics["eval/heldout/reward_mean"] == 1.0


def test_each_rollout_names_the_rollout_that_evaluates_it(tiny_checkpoint, data_file, tmp_path):
    def evaluation(*flags: str):
        config = _config(tiny_checkpoint, data_file, tmp_path, *flags)
        return load_rollout(config.rollout, run_config=config).for_evaluation()

    tool = ("--rollout-function-path", "miles.rollout.tool_rollout:ToolRollout")
    sft = ("--rollout-function-path", "miles.rollout.sft_rollout:SftRollout",
           "--loss-type", "sft_loss")  # fmt: skip
    assert type(evaluation(*TOOL_FLAGS, *tool)) is ToolRollout
    assert type(evaluation(*TOOL_FLAGS, *sft)) is ToolRollout
    assert type(evaluation("--apply-chat-template", *sft)) is SingleTurnRollout
    assert type(evaluation()) is SingleTurnRollout
    # A whole-rollout function of the earlier signature is evaluated the built-in way.
    legacy = evaluation("--rollout-function-path", "custom_rollout_fns:whole_rollout")
    assert type(legacy) is SingleTurnRollout


class _Rows:
    """A data source of one chat row (with a label) per prompt."""

    def __init__(self, messages: list[dict]) -> None:
        self.messages = messages

    def get_samples(self, num_prompts: int) -> list[list[Sample]]:
        return [[Sample(index=i, group_index=i, messages=self.messages, tokens=[1], label="5")]
                for i in range(num_prompts)]  # fmt: skip


def _sft_context(config, source: _Rows):
    tokenizer = load_tokenizer(config.checkpoint.hf_checkpoint)
    return rollout_context(None, source, None, config.rollout, data=config.data,
                           tokenizer=tokenizer)  # fmt: skip


def test_a_warm_up_with_tools_trains_after_the_prompt_the_tool_rollout_opens_with(
    tiny_checkpoint, data_file, tmp_path
):
    config = _config(tiny_checkpoint, data_file, tmp_path, *TOOL_FLAGS,
                     "--rollout-function-path", "miles.rollout.sft_rollout:SftRollout",
                     "--loss-type", "sft_loss")  # fmt: skip
    # A row holding a call and its result: the warm-up teaches the answer that follows them.
    chat = [{"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
            {"role": "tool", "content": "5"}]  # fmt: skip
    ctx = _sft_context(config, _Rows(chat))
    (group,) = asyncio.run(SftRollout.from_config(config.rollout).generate_rollout(ctx, 0)).groups
    sample = group[0]
    agent = ToolAgent.for_context(ctx)
    prompt = agent.first_prompt(sample)
    tokenizer = agent.tokenizer
    assert '"name": "add"' in tokenizer.decode(prompt)  # the tools are shown, as in the rollout
    assert tokenizer.decode(prompt).endswith("<tool_response>5</tool_response><|im_end|>\n"
                                             "<|im_start|>assistant\n")  # fmt: skip
    assert sample.tokens == [*prompt, *tokenizer.encode("5"), tokenizer.eos_token_id]
    assert sample.loss_mask == [1, 1] and sample.response_length == 2


def test_a_warm_up_without_tools_keeps_the_data_sources_prompt(
    tiny_checkpoint, data_file, tmp_path
):
    config = _config(tiny_checkpoint, data_file, tmp_path, "--apply-chat-template",
                     "--rollout-function-path", "miles.rollout.sft_rollout:SftRollout",
                     "--loss-type", "sft_loss")  # fmt: skip
    chat = [{"role": "user", "content": QUESTION}]
    ctx = _sft_context(config, _Rows(chat))
    (group,) = asyncio.run(SftRollout.from_config(config.rollout).generate_rollout(ctx, 0)).groups
    assert group[0].tokens[0] == 1  # the data source's tokens, followed by the label
