"""Multi-task recipes end to end (real Ray, FSDP on gloo, the reference engine), in one run: it
trains on a two-source mixture (the max task scored by exact match, and a generated word task
whose rows name their own reward) and evaluates on three datasets through --eval-config, each
with its own n, temperature, length and reward (exact match, F1, a custom function), one on its
own interval. Every per-source, per-reward and per-dataset metric is reported, the sources are
drawn by weight, and a resumed run draws exactly what the uninterrupted one drew."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import ray
import yaml

from miles.config import load_config
from miles.train import train
from miles.utils.checkpoint_layout import POINTER_FILE
from miles.utils.tracking import read_metrics
from tests.e2e.assets import tiny_run_assets
from tests.e2e.eval_rewards import MARK
from tools.compare_runs import compare_records

pytestmark = pytest.mark.timeout(900)

# One engine, one request at a time: the resumed run must draw and sample what the first drew.
FLAGS = ["--rollout-batch-size", "8", "--n-samples-per-prompt", "2", "--rollout-max-response-len",
         "3", "--rm-type", "exact_match", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus",
         "1", "--rollout-concurrency", "1", "--console", "plain", "--lr", "1e-3",
         "--rollout-router", "builtin", "--num-rollout", "3", "--save-interval", "1"]  # fmt: skip


EVAL_PROMPTS = 4
# name -> the held-out dataset's settings; the run's own are n 1 and 3 tokens (FLAGS).
DATASETS = {
    "exact": {"rm_type": "exact_match", "n_samples_per_eval_prompt": 4, "temperature": 1.0,
              "max_response_len": 2, "pass_at_k": [1, 2, 4]},
    "overlap": {"rm_type": "f1", "n_samples_per_eval_prompt": 1, "temperature": 0.0,
                "max_response_len": 5, "eval_interval": 1},
    "marked": {"custom_rm_path": "tests.e2e.eval_rewards:marked", "n_samples_per_eval_prompt": 2,
               "temperature": 0.7, "max_response_len": 4},
}  # fmt: skip


@pytest.fixture(scope="module")
def mixture_run(tmp_path_factory) -> tuple[Path, Path, Path, list[dict]]:
    """(root, model, mixture file, records) of a 3-rollout run on the mixture, saved every
    rollout to root/checkpoints, its output in root/run."""
    root = tmp_path_factory.mktemp("recipes")
    checkpoint, max_task = tiny_run_assets(root)
    # The second task: repeat a word; f1 on most rows, exact match named by some rows.
    words = ["red", "green", "blue", "one", "two", "three"]
    rows = [{"question": f"say {w}:", "answer": w} for w in words]
    rows += [{"question": f"repeat {w}:", "answer": w, "meta": {"rm_type": "exact_match"}}
             for w in words]  # fmt: skip
    (root / "words.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    heldout = root / "heldout.jsonl"
    heldout.write_text("".join(max_task.read_text().splitlines(keepends=True)[:EVAL_PROMPTS]))
    entries = [{"name": name, "path": str(heldout), **settings}
               for name, settings in DATASETS.items()]  # fmt: skip
    (root / "eval.yaml").write_text(yaml.safe_dump({"eval": {"datasets": entries}}))
    mixture = root / "mixture.yaml"
    mixture.write_text(
        "sources:\n"
        f"  - {{name: max, path: {max_task.name}, weight: 0.6}}\n"
        "  - {name: words, path: words.jsonl, weight: 0.4, input_key: question,\n"
        "     label_key: answer, metadata_key: meta, rm_type: f1}\n"
    )
    records = run(checkpoint, mixture, root / "run", "--save", str(root / "checkpoints"))
    yield root, checkpoint, mixture, records
    if ray.is_initialized():
        ray.shutdown()


def run(checkpoint: Path, mixture: Path, out: Path, *flags: str) -> list[dict]:
    train(load_config(["--hf-checkpoint", str(checkpoint), "--prompt-data", str(mixture),
                       "--eval-config", str(mixture.parent / "eval.yaml"),
                       "--output-dir", str(out), *FLAGS, *flags]))  # fmt: skip
    return read_metrics(out / "metrics.jsonl")


def test_a_mixture_run_reports_each_source_and_each_reward(mixture_run):
    *_, records = mixture_run
    assert [r["rollout_id"] for r in records] == [-1, 0, 1, 2]
    draws = {"max": 0.0, "words": 0.0}
    for record in records[1:]:
        for source in draws:
            draws[source] += record.get(f"rollout/{source}/samples", 0.0)
            if f"rollout/{source}/samples" in record:
                assert math.isfinite(record[f"rollout/{source}/reward_mean"])
        # The max rows and the 'repeat' rows score by exact match, the 'say' rows by f1.
        names = {key.split("/")[1] for key in record if key.endswith("/samples")
                 and key.startswith("reward/")}  # fmt: skip
        assert names <= {"exact_match", "f1"} and names, record
        scored = sum(record[f"reward/{name}/samples"] for name in names)
        assert scored == record["rollout/samples"] == 16.0
        assert record["reward/f1/samples"] <= record["rollout/words/samples"]
    # 24 prompts at weight 0.6 / 0.4 (sd 2.4 prompts): within 3 sd.
    assert abs(draws["max"] / 2 - 14.4) <= 7.2, draws
    assert draws["max"] + draws["words"] == 48.0


def test_a_resumed_mixture_run_draws_what_the_uninterrupted_one_drew(mixture_run, tmp_path):
    root, model, mixture, records = mixture_run
    saved = tmp_path / "checkpoints"
    shutil.copytree(root / "checkpoints", saved)
    shutil.copytree(root / "run", tmp_path / "run")
    (saved / POINTER_FILE).write_text("1")  # as if it crashed while saving rollout 2
    resumed = run(model, mixture, tmp_path / "run", "--save", str(saved))
    assert [r["rollout_id"] for r in resumed] == [-1, 0, 1, 2]
    # Every non-timing value of the rerun rollout, per source, reward and dataset, to the bit.
    assert compare_records([records[-1]], [resumed[-1]], ignore=["^check/"]) == []


def evaluated(records: list[dict], name: str) -> dict[int, dict]:
    """{rollout id: that record's eval/<name>/* metrics} over the records evaluating `name`."""
    prefix = f"eval/{name}/"
    return {
        r["rollout_id"]: {k.removeprefix(prefix): v for k, v in r.items() if k.startswith(prefix)}
        for r in records
        if f"{prefix}reward_mean" in r
    }


def test_each_dataset_is_evaluated_before_training_on_its_interval_and_after_the_last(
    mixture_run,
):
    *_, records = mixture_run
    assert sorted(evaluated(records, "overlap")) == [-1, 0, 1, 2]  # eval_interval: 1
    assert sorted(evaluated(records, "exact")) == [-1, 2]  # the run's: no --eval-interval
    assert sorted(evaluated(records, "marked")) == [-1, 2]
    assert all("eval/reward_mean" in r and "time/eval_s" in r for r in records)


def test_each_dataset_reports_its_metrics_with_its_pass_at_k(mixture_run):
    *_, records = mixture_run
    for name, settings in DATASETS.items():
        ks = settings.get("pass_at_k", sorted({1, settings["n_samples_per_eval_prompt"]}))
        for rollout_id, metrics in evaluated(records, name).items():
            expected = {"reward_mean", "response_len_mean", "response_len_max", "samples",
                        "truncated_ratio", *(f"pass@{k}" for k in ks)}  # fmt: skip
            assert expected <= set(metrics), (name, rollout_id, sorted(metrics))
            assert not {k for k in metrics if k.startswith("pass@")} - {f"pass@{k}" for k in ks}


def test_each_dataset_is_sampled_with_its_n_and_length(mixture_run):
    *_, records = mixture_run
    for name, settings in DATASETS.items():
        limit = settings["max_response_len"]
        for metrics in evaluated(records, name).values():
            assert metrics["samples"] == EVAL_PROMPTS * settings["n_samples_per_eval_prompt"], name
            assert 1 <= metrics["response_len_max"] <= limit, name
            if metrics["truncated_ratio"] > 0:  # a truncated answer is exactly the limit long
                assert metrics["response_len_max"] == limit, name


def test_the_custom_reward_scores_its_dataset_and_no_other(mixture_run):
    *_, records = mixture_run
    for metrics in evaluated(records, "marked").values():
        assert metrics["reward_mean"] == MARK and metrics["pass@1"] == 0.0
    for name in ("exact", "overlap"):
        for metrics in evaluated(records, name).values():
            assert 0.0 <= metrics["reward_mean"] <= 1.0, name
