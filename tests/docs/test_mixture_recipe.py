"""docs/guides/recipes.md, "Training on a mixture": the page shows the CPU demo's mixture as it is
in examples/, its command line builds that configuration, and both sources read with their own
columns and rewards."""

from __future__ import annotations

import shlex
from pathlib import Path

from transformers import AutoTokenizer

from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint
from miles.config import load_config
from miles.rollout.data_source import PromptDataset
from miles.rollout.mixture import source_config
from miles.rollout.rewards.sample_reward import SampleReward, sample_reward
from tests.docs.guide import block, blocks

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/cpu_demo/mixture.yaml"


def test_the_page_shows_the_example_file_as_it_is():
    assert block("recipes.md", EXAMPLE, language="yaml") == (REPO / EXAMPLE).read_text()


def test_the_pages_command_trains_on_both_sources_with_their_columns_and_rewards(
    monkeypatch, tmp_path
):
    monkeypatch.chdir(REPO)
    (command,) = [b for b in blocks("recipes.md", "bash") if f"--prompt-data {EXAMPLE}" in b]
    argv = shlex.split(command)
    assert argv[:2] == ["miles", "train"]
    # The demo's SFT checkpoint is made by run.sh; a tiny one stands in for it.
    checkpoint = build_tiny_checkpoint(tmp_path / "ckpt")
    config = load_config([*argv[2:], "--hf-checkpoint", str(checkpoint)])
    max_source, min_source = config.data.mixture
    assert (max_source.name, max_source.weight, min_source.weight) == ("max", 0.8, 0.2)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    run_reward = config.reward  # the demo's exact match
    read = {}
    for source in config.data.mixture:
        own = sample_reward(source.reward, run_reward) if source.reward else None
        reward = own.config(run_reward) if own else run_reward
        read[source.name] = PromptDataset(source_config(config.data, source), tokenizer,
                                          reward=reward)  # fmt: skip
    assert len(read["max"]) == 70 and len(read["min"]) == 24
    first = read["min"][0]
    assert first.prompt.startswith("min(") and first.label in "0123456789"
    assert read["min"].own_rewards == {
        SampleReward("exact_match"): f"--prompt-data {REPO / 'examples/cpu_demo/data/min.jsonl'}:1"
    }
