"""A training mixture (`--prompt-data mixture.yaml`): its file is checked before start-up, naming
the source; prompts are drawn from the sources by weight, deterministically and exactly across
resume; each source brings its own columns and reward; rollouts report each source's numbers."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint
from miles.backends.training_utils.batching.sample import Sample
from miles.config import load_config
from miles.rollout.data_source import DataSourceConfig, PromptDataset, RolloutDataSource
from miles.rollout.mixture import SOURCE_KEY, source_config
from miles.rollout.rewards import RewardConfig
from miles.rollout.train_data import rollout_metrics

EXACT = RewardConfig(rm_type="exact_match")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_tiny_checkpoint(tmp_path_factory.mktemp("t") / "c"))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def mixture(tmp_path) -> Path:
    """`max` (the run's columns and reward) at 0.7, `words` (its own columns, f1) at 0.3."""
    write_jsonl(tmp_path / "max.jsonl", [{"input": f"max({a},1)=", "label": str(max(a, 1))}
                                         for a in range(5)])  # fmt: skip
    words = [{"question": f"say {w}", "answer": w} for w in ("red", "green", "blue")]
    words.append({"question": "say four", "answer": "4", "metadata": {"rm_type": "math"}})
    write_jsonl(tmp_path / "words.jsonl", words)
    path = tmp_path / "mix.yaml"
    path.write_text(
        "sources:\n"
        "  - {name: max, path: max.jsonl, weight: 0.7}\n"
        "  - {name: words, path: words.jsonl, weight: 0.3, input_key: question,\n"
        "     label_key: answer, rm_type: f1}\n"
    )
    return path


def data_source(mixture: Path, tokenizer, seed: int = 3) -> RolloutDataSource:
    config = DataSourceConfig(prompt_data=str(mixture), rollout_seed=seed)
    read = []
    for source in config.mixture:
        reward = EXACT if not source.reward else RewardConfig(rm_type=source.reward["rm_type"])
        read.append(
            (source, PromptDataset(source_config(config, source), tokenizer, reward=reward))
        )
    return RolloutDataSource(read[0][1], config, n_samples_per_prompt=2, mixture=read)


def drawn(source: RolloutDataSource, prompts: int) -> list[tuple[str, str]]:
    return [(g[0].metadata[SOURCE_KEY], g[0].prompt) for g in source.get_samples(prompts)]


def test_prompts_come_from_the_sources_by_weight_with_their_own_columns_and_reward(
    mixture, tokenizer
):
    source = data_source(mixture, tokenizer)
    groups = source.get_samples(2000)
    counts = Counter(g[0].metadata[SOURCE_KEY] for g in groups)
    # Binomial(2000, 0.7): sd 20.5; within 4 sd.
    assert abs(counts["max"] - 1400) < 82, counts
    words = [g[0] for g in groups if g[0].metadata[SOURCE_KEY] == "words"]
    assert {s.prompt for s in words} == {"say red", "say green", "say blue", "say four"}
    by_prompt = {s.prompt: s for s in words}
    assert by_prompt["say red"].label == "red" and by_prompt["say red"].metadata["rm_type"] == "f1"
    assert by_prompt["say four"].metadata["rm_type"] == "math"  # the row's own reward stays
    maxed = next(g[0] for g in groups if g[0].metadata[SOURCE_KEY] == "max")
    assert "rm_type" not in maxed.metadata  # the run's reward
    # Group and sample indices run over the whole run, whatever the source.
    assert [g[0].group_index for g in groups[:5]] == [0, 1, 2, 3, 4]


def test_the_draws_are_seeded_and_a_resumed_source_continues_exactly(mixture, tokenizer):
    uninterrupted = data_source(mixture, tokenizer)
    first, rest = drawn(uninterrupted, 37), drawn(uninterrupted, 60)
    assert drawn(data_source(mixture, tokenizer), 37) == first  # the same seed, the same draws
    assert drawn(data_source(mixture, tokenizer, seed=4), 37) != first

    interrupted = data_source(mixture, tokenizer)
    drawn(interrupted, 37)
    state = json.loads(json.dumps(interrupted.state_dict()))  # as written to the checkpoint
    resumed = data_source(mixture, tokenizer)
    resumed.load_state_dict(state)
    assert drawn(resumed, 60) == rest
    plain = DataSourceConfig(prompt_data=str(mixture.parent / "max.jsonl"))
    one_file = RolloutDataSource(
        PromptDataset(plain, tokenizer), plain, n_samples_per_prompt=2
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"format 2 \(a mixture\), this run reads 1"):
        one_file.load_state_dict(state)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{name: b, path: b.jsonl, weight: 0}", r"source 'b': `weight` must be a positive"),
        ("{name: b, path: b.jsonl, wieght: 1}", r"source 'b': unknown key 'wieght' \(did you "
                                                r"mean 'weight'\?\)"),
        ("{name: b, path: nope.jsonl, weight: 1}", r"source 'b': path 'nope.jsonl' is not a file"),
        ("{name: a, path: b.jsonl, weight: 1}", r"source names must differ, \['a'\] repeat"),
        ("{name: b, path: b.jsonl, weight: 1, custom_rm_path: m:f}",
         r"source 'b': \['custom_rm_path'\] need an `rm_type`"),
        ("{name: b, path: b.jsonl, weight: 1, rm_type: exact-match}",
         r"source 'b': metadata rm_type 'exact-match' is not a reward type"),
    ],
)  # fmt: skip
def test_a_bad_mixture_is_refused_before_start_up_naming_the_source(tmp_path, source, message):
    for name in ("a", "b"):
        write_jsonl(tmp_path / f"{name}.jsonl", [{"input": "x", "label": "y"}])
    path = tmp_path / "mix.yaml"
    path.write_text(f"sources:\n  - {{name: a, path: a.jsonl, weight: 1}}\n  - {source}\n")
    checkpoint = build_tiny_checkpoint(tmp_path / "ckpt")
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_config(["--hf-checkpoint", str(checkpoint), "--prompt-data", str(path),
                     "--rm-type", "exact_match", "--rollout-batch-size", "2"])  # fmt: skip


def test_a_rollout_reports_each_sources_reward_and_samples():
    def sample(source: str, reward: float) -> Sample:
        return Sample(prompt="p", tokens=[1, 2], response_length=1, reward=reward,
                      metadata={SOURCE_KEY: source})  # fmt: skip

    groups = [
        [sample("max", 1.0), sample("max", 0.0)],
        [sample("words", 0.5), sample("words", 1.0)],
    ]
    metrics = rollout_metrics(groups)
    assert metrics["rollout/max/reward_mean"] == 0.5 and metrics["rollout/max/samples"] == 2.0
    assert metrics["rollout/words/reward_mean"] == 0.75 and metrics["rollout/reward_mean"] == 0.625
