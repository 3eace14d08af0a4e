"""A row's own reward (`metadata["rm_type"]`): the hub scores each sample with the reward its
metadata names, falls back to the run's, tallies by reward; bad names are refused at data load,
naming the row."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint
from miles.backends.training_utils.batching.sample import Sample
from miles.rollout.data_source import DataSourceConfig, PromptDataset
from miles.rollout.rewards import RewardConfig, RewardHub
from miles.rollout.rewards.sample_reward import SampleReward, sample_reward

HERE = Path(__file__).parent
EXACT = RewardConfig(rm_type="exact_match")


@pytest.fixture(autouse=True)
def custom_rewards_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def sample(response: str, label: str, group: int = 0, **metadata) -> Sample:
    return Sample(prompt="q", tokens=[1, 2], response=response, response_length=1, label=label,
                  group_index=group, metadata=metadata)  # fmt: skip


def score(config: RewardConfig, samples: list[Sample]):
    async def run():
        async with RewardHub(config) as hub:
            return await hub.score(samples)

    return asyncio.run(run())


def test_each_sample_is_scored_by_the_reward_its_metadata_names():
    samples = [
        sample("4", "4"),  # the run's exact_match
        sample("the answer is 4", "4", rm_type="f1"),  # 'the' dropped: 2 * (1/3 * 1) / (4/3)
        sample("abc", "x", rm_type="custom", custom_rm_path="custom_rewards:async_length"),
        sample("$\\frac{1}{2}$", "0.5", rm_type="math"),
        sample("no", "x", rm_type="custom", custom_rm_path="custom_rewards:flaky"),
        sample("boom", "boom", rm_type="custom", custom_rm_path="custom_rewards:flaky"),
    ]
    report = score(EXACT, samples)
    assert report.rewards == pytest.approx([1.0, 0.5, 3.0, 1.0, 1.0, 0.0])
    assert report.failures == 1 and "cannot score 'boom'" in report.failure_messages[0]
    metrics = report.metrics()
    assert metrics["reward/exact_match/mean"] == 1.0 and metrics["reward/f1/mean"] == 0.5
    assert metrics["reward/async_length/mean"] == 3.0 and metrics["reward/math/samples"] == 1.0
    assert metrics["reward/flaky/mean"] == 0.5 and metrics["reward/flaky/failures"] == 1.0


def test_a_run_whose_rows_name_no_reward_reports_as_before():
    report = score(EXACT, [sample("4", "4"), sample("5", "4")])
    assert report.rewards == [1.0, 0.0] and not report.named_own
    assert set(report.metrics()) == {"reward/failures", "reward/failure_rate"}


def test_a_custom_row_uses_the_runs_function_and_group_calls_stay_per_reward():
    run = RewardConfig(rm_type="custom", custom_rm_path="custom_rewards:group_mean_rank",
                       group_rm=True)  # fmt: skip
    assert sample_reward({"rm_type": "custom"}, run) == SampleReward(
        "custom", "custom_rewards:group_mean_rank"
    )
    # A group of the run's reward is one call; a group of exact_match rows is scored one by one.
    samples = [sample("a", "a", 0), sample("bb", "a", 0),
               sample("a", "a", 1, rm_type="exact_match"), sample("b", "a", 1, rm_type="exact_match")]  # fmt: skip
    report = score(run, samples)
    assert report.rewards[2:] == [1.0, 0.0] and report.failures == 0


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"rm_type": "exact-match"}, r"rm_type 'exact-match' is not a reward type \(did you "
                                     r"mean 'exact_match'\?\)"),
        ({"rm_type": "custom"}, r"--rm-type custom needs --custom-rm-path"),
        ({"custom_rm_path": "m:f"}, r"names \['custom_rm_path'\] but no 'rm_type'"),
        ({"rm_type": "remote", "rm_url": "ftp://x"}, r"must be an http:// or https:// URL"),
        ({"rm_type": "custom", "custom_rm_path": "not a path"}, r"is not an import path"),
    ],
)  # fmt: skip
def test_a_bad_row_reward_is_refused_at_load_naming_the_file_and_line(
    tmp_path, tokenizer, metadata, message
):
    rows = [{"input": "a", "label": "1"}, {"input": "b", "label": "2", "metadata": metadata}]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=rf"data.jsonl:2: .*{message}"):
        PromptDataset(DataSourceConfig(prompt_data=str(path)), tokenizer, reward=EXACT)


def test_rows_need_a_label_exactly_when_their_own_reward_reads_one(tmp_path, tokenizer):
    custom = {"rm_type": "custom", "custom_rm_path": "custom_rewards:async_length"}
    rows = [{"input": "a", "label": "1"}, {"input": "b", "metadata": custom}]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = PromptDataset(DataSourceConfig(prompt_data=str(path)), tokenizer, reward=EXACT)
    assert len(dataset) == 2
    assert dataset.own_rewards == {
        SampleReward("custom", "custom_rewards:async_length"): f"--prompt-data {path}:2"
    }
    rows[1]["metadata"] = {"rm_type": "f1"}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"data.jsonl:2: no label"):
        PromptDataset(DataSourceConfig(prompt_data=str(path)), tokenizer, reward=EXACT)


def test_a_row_reward_that_cannot_be_imported_is_an_error_naming_its_first_row():
    hub = RewardHub(EXACT)
    missing = SampleReward("custom", "custom_rewards:no_such_function")
    with pytest.raises(ValueError, match=r"data.jsonl:7: its reward 'no_such_function'"):
        hub.check_rewards({missing: "data.jsonl:7"})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_tiny_checkpoint(tmp_path_factory.mktemp("t") / "c"))
