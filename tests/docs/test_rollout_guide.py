"""docs/guides/adding-a-rollout-function.md: its modules run as the page writes them."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest

from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint
from miles.backends.training_utils.batching.sample import Sample, SampleStatus
from miles.rollout.loader import load_rollout
from miles.rollout.rollout_config import RolloutConfig
from miles.utils.tokenizers import load_tokenizer
from tests.support.rollout_context import rollout_context

GUIDE = Path(__file__).resolve().parents[2] / "docs/guides/adding-a-rollout-function.md"


def guide_module(name: str) -> str:
    """The python block of the guide that opens with `# {name}`."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
    (block,) = [b for b in blocks if b.startswith(f"# {name}\n")]
    return block


@pytest.fixture
def guide_modules(tmp_path, monkeypatch):
    for name in ("my_rollout.py", "my_filter.py"):
        (tmp_path / name).write_text(guide_module(name))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("my_rollout", "my_filter"):
        sys.modules.pop(name, None)


class CalculatorEngine:
    """A stand-in engine: asks the calculator for 12 * 7 until it reads a result, then answers."""

    router_url, fault_tolerant = None, False

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.requests = tokenizer, []

    async def generate(self, payload: dict) -> dict | list[dict]:
        self.requests.append(payload)
        context = self.tokenizer.decode(payload["input_ids"])
        text = "It is 84." if "<result>" in context else "<calc>12 * 7</calc>"
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        meta = {"finish_reason": {"type": "stop"}, "weight_version": "0",
                "output_token_logprobs": [[-0.5, i, None] for i in ids]}  # fmt: skip
        return {"text": text, "output_ids": ids, "meta_info": meta}

    async def abort_all(self) -> None:
        pass


class Questions:
    def __init__(self, tokenizer) -> None:
        self.prompt = tokenizer("What is 12 * 7? ", add_special_tokens=False)["input_ids"]
        self.served = 0

    def get_samples(self, num_prompts: int) -> list[list[Sample]]:
        groups = []
        for _ in range(num_prompts):
            g, self.served = self.served, self.served + 1
            groups.append([Sample(index=2 * g + i, group_index=g, tokens=list(self.prompt),
                                  prompt="What is 12 * 7? ") for i in range(2)])  # fmt: skip
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        raise AssertionError("nothing is left over")


def test_the_calculator_rollout_runs_in_the_built_in_loop_by_its_flag(guide_modules, tmp_path):
    tokenizer = load_tokenizer(str(build_tiny_checkpoint(tmp_path / "tiny", seed=0)))
    engine = CalculatorEngine(tokenizer)
    config = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2,
                           rollout_max_response_len=64,
                           rollout_function_path="my_rollout:CalculatorRollout")  # fmt: skip

    async def score(groups):
        for sample in (s for group in groups for s in group):
            sample.reward = float(sample.response.endswith("It is 84."))

    ctx = rollout_context(engine, Questions(tokenizer), score, config, tokenizer=tokenizer)
    output = asyncio.run(load_rollout(config).generate_rollout(ctx, 0))

    assert len(engine.requests) == 2 * 4  # each sample: the call, then the answer
    assert all("</calc>" in r["sampling_params"]["stop"] for r in engine.requests)
    result = tokenizer("<result>84</result>", add_special_tokens=False)["input_ids"]
    for sample in (s for group in output.groups for s in group):
        assert sample.response == "<calc>12 * 7</calc><result>84</result>It is 84."
        assert sample.reward == 1.0 and sample.status == SampleStatus.COMPLETED
        call = len(tokenizer("<calc>12 * 7</calc>", add_special_tokens=False)["input_ids"])
        # The model's tokens are trained on, the calculator's are not.
        assert sample.loss_mask[call : call + len(result)] == [0] * len(result)
        assert sample.loss_mask[:call] == [1] * call and sample.loss_mask[-1] == 1
        sample.validate()


def test_the_filter_keeps_groups_with_a_reward_spread_and_few_truncations(guide_modules):
    from my_filter import keep_informative

    def group(rewards, truncated=0):
        return [Sample(index=i, reward=r, status=SampleStatus.TRUNCATED if i < truncated
                       else SampleStatus.COMPLETED) for i, r in enumerate(rewards)]  # fmt: skip

    assert keep_informative(group([0.0, 1.0, 1.0, 0.0])) is True
    assert keep_informative(group([1.0, 1.0, 1.0, 1.0])) is False
    assert keep_informative(group([0.0, 1.0, 1.0, 0.0], truncated=2)) is False
