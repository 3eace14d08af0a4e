"""Short RL runs with the Megatron backend on a GPU (skipped without one; run by the cuda session):
GRPO saved and resumed, and PPO with a critic on the policy's GPU, colocated with the engine."""

from __future__ import annotations

import pytest
import torch

from miles.config import load_config
from miles.train import train
from miles.utils.checkpoint_layout import POINTER_FILE
from miles.utils.tracking import read_metrics
from tests.e2e.assets import tiny_run_assets

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.timeout(900),
]


def megatron_flags(tmp_path) -> list[str]:
    """A colocated float32 run on the reference engine, saving every rollout to tmp_path/save."""
    checkpoint, data = tiny_run_assets(tmp_path, operands=5)
    return [
        "--hf-checkpoint", str(checkpoint), "--prompt-data", str(data),
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "4", "--rm-type", "exact_match",
        "--train-backend", "megatron", "--params-dtype", "float32", "--lr", "1e-4",
        "--rollout-engine", "reference", "--colocate", "--save", str(tmp_path / "save"),
        "--save-interval", "1", "--output-dir", str(tmp_path / "run"), "--console", "plain",
    ]  # fmt: skip


def test_megatron_backend_trains_saves_and_resumes_on_a_gpu(tmp_path):
    flags = megatron_flags(tmp_path)
    train(load_config([*flags, "--num-rollout", "2"]))
    train(load_config([*flags, "--num-rollout", "3"]))  # resumes at rollout 2
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["rollout_id"] for r in records] == [0, 1, 2]
    assert records[0]["check/logprob_abs_diff"] < 1e-3  # the engine runs the trained weights
    assert all("train/grad_norm" in r for r in records)


def test_a_megatron_ppo_run_trains_its_critic_after_a_critic_only_rollout_and_saves_both(tmp_path):
    """--advantage-estimator ppo on Megatron: the critic shares the policy's GPU (asleep with it
    while the engine generates); the first rollout trains it alone; both are saved."""
    flags = [*megatron_flags(tmp_path), "--num-rollout", "2", "--advantage-estimator", "ppo",
             "--num-critic-only-steps", "1", "--critic-lr", "1e-4"]  # fmt: skip
    train(load_config(flags))
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert "train/loss" not in records[0] and "train/loss" in records[1]
    for record in records:
        assert 0 < record["critic/grad_norm"] < float("inf")
        assert "critic/explained_variance" in record and "critic/returns_mean" in record
    save = tmp_path / "save"
    assert (save / POINTER_FILE).read_text().strip() == "1"
    assert (save / "critic" / POINTER_FILE).read_text().strip() == "1"
