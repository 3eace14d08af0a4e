"""Evaluation on several datasets through --eval-config, in a whole `miles train` (in-process: real
Ray, FSDP on gloo, the reference engine): three datasets with their own n, temperature, length and
reward (exact match, F1, a custom function), one of them on its own interval."""

from __future__ import annotations

import pytest
import ray
import yaml

from miles.config import load_config
from miles.train import train
from miles.utils.tracking import read_metrics
from tests.e2e.assets import tiny_run_assets
from tests.e2e.eval_rewards import MARK

pytestmark = pytest.mark.timeout(600)

PROMPTS = 4
# name -> the dataset's settings; the run's own are n 1 and 3 tokens (tiny_flags below).
DATASETS = {
    "exact": {"rm_type": "exact_match", "n_samples_per_eval_prompt": 4, "temperature": 1.0,
              "max_response_len": 2, "pass_at_k": [1, 2, 4]},
    "overlap": {"rm_type": "f1", "n_samples_per_eval_prompt": 1, "temperature": 0.0,
                "max_response_len": 5, "eval_interval": 1},
    "marked": {"custom_rm_path": "tests.e2e.eval_rewards:marked", "n_samples_per_eval_prompt": 2,
               "temperature": 0.7, "max_response_len": 4},
}  # fmt: skip


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("eval_config")
    checkpoint, data = tiny_run_assets(root / "assets")
    heldout = root / "heldout.jsonl"
    heldout.write_text("".join(data.read_text().splitlines(keepends=True)[:PROMPTS]))
    entries = [
        {"name": name, "path": str(heldout), **settings} for name, settings in DATASETS.items()
    ]
    eval_config = root / "eval.yaml"
    eval_config.write_text(yaml.safe_dump({"eval": {"datasets": entries}}))
    out = root / "run"
    train(load_config([
        "--hf-checkpoint", str(checkpoint), "--prompt-data", str(data),
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "3", "--rm-type", "exact_match",
        "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1", "--num-rollout", "2",
        "--output-dir", str(out), "--console", "plain", "--lr", "1e-3",
        "--rollout-router", "builtin", "--eval-config", str(eval_config),
    ]))  # fmt: skip
    yield read_metrics(out / "metrics.jsonl")
    if ray.is_initialized():
        ray.shutdown()


def evaluated(records: list[dict], name: str) -> dict[int, dict]:
    """{rollout id: that record's eval/<name>/* metrics} over the records evaluating `name`."""
    prefix = f"eval/{name}/"
    return {
        r["rollout_id"]: {k.removeprefix(prefix): v for k, v in r.items() if k.startswith(prefix)}
        for r in records
        if f"{prefix}reward_mean" in r
    }


def test_each_dataset_is_evaluated_before_training_on_its_interval_and_after_the_last(records):
    assert [r["rollout_id"] for r in records] == [-1, 0, 1]
    assert sorted(evaluated(records, "overlap")) == [-1, 0, 1]  # eval_interval: 1
    assert sorted(evaluated(records, "exact")) == [-1, 1]  # the run's: no --eval-interval
    assert sorted(evaluated(records, "marked")) == [-1, 1]
    assert all("eval/reward_mean" in r and "time/eval_s" in r for r in records)


def test_each_dataset_reports_its_metrics_with_its_pass_at_k(records):
    for name, settings in DATASETS.items():
        ks = settings.get("pass_at_k", sorted({1, settings["n_samples_per_eval_prompt"]}))
        for rollout_id, metrics in evaluated(records, name).items():
            expected = {"reward_mean", "response_len_mean", "response_len_max", "samples",
                        "truncated_ratio", *(f"pass@{k}" for k in ks)}  # fmt: skip
            assert expected <= set(metrics), (name, rollout_id, sorted(metrics))
            assert not {k for k in metrics if k.startswith("pass@")} - {f"pass@{k}" for k in ks}


def test_each_dataset_is_sampled_with_its_n_and_length(records):
    for name, settings in DATASETS.items():
        limit = settings["max_response_len"]
        for metrics in evaluated(records, name).values():
            assert metrics["samples"] == PROMPTS * settings["n_samples_per_eval_prompt"], name
            assert 1 <= metrics["response_len_max"] <= limit, name
            if metrics["truncated_ratio"] > 0:  # a truncated answer is exactly the limit long
                assert metrics["response_len_max"] == limit, name


def test_the_custom_reward_scores_its_dataset_and_no_other(records):
    for metrics in evaluated(records, "marked").values():
        assert metrics["reward_mean"] == MARK and metrics["pass@1"] == 0.0
    for name in ("exact", "overlap"):
        for metrics in evaluated(records, name).values():
            assert 0.0 <= metrics["reward_mean"] <= 1.0, name
