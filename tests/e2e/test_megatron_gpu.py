"""A short RL run with the Megatron backend on a GPU (skipped without one; run by the cuda session)."""

from __future__ import annotations

import pytest
import torch

from miles.config import load_config
from miles.train import train
from miles.utils.tracking import read_metrics
from tests.e2e.assets import tiny_run_assets

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.timeout(900),
]


def test_megatron_backend_trains_saves_and_resumes_on_a_gpu(tmp_path):
    checkpoint, data = tiny_run_assets(tmp_path, operands=5)
    flags = [
        "--hf-checkpoint", str(checkpoint), "--prompt-data", str(data),
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "4", "--rm-type", "exact_match",
        "--train-backend", "megatron", "--params-dtype", "float32", "--lr", "1e-4",
        "--rollout-engine", "reference", "--colocate", "--save", str(tmp_path / "save"),
        "--save-interval", "1", "--output-dir", str(tmp_path / "run"), "--console", "plain",
    ]  # fmt: skip
    train(load_config([*flags, "--num-rollout", "2"]))
    train(load_config([*flags, "--num-rollout", "3"]))  # resumes at rollout 2
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["rollout_id"] for r in records] == [0, 1, 2]
    assert records[0]["check/logprob_abs_diff"] < 1e-3  # the engine runs the trained weights
    assert all("train/grad_norm" in r for r in records)
