"""Multi-task recipes end to end (real Ray, FSDP on gloo, the reference engine): a run on a
two-source mixture (the max task scored by exact match, and a generated word task whose rows
name their own reward) reports every per-source and per-reward metric, draws its sources by
weight, and a resumed mixture run draws exactly what the uninterrupted one drew."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import ray

from miles.config import load_config
from miles.train import train
from miles.utils.checkpoint_layout import POINTER_FILE
from miles.utils.tracking import read_metrics
from tests.e2e.assets import tiny_run_assets
from tools.compare_runs import compare_records

pytestmark = pytest.mark.timeout(900)

# One engine, one request at a time: the resumed run must draw and sample what the first drew.
FLAGS = ["--rollout-batch-size", "8", "--n-samples-per-prompt", "2", "--rollout-max-response-len",
         "3", "--rm-type", "exact_match", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus",
         "1", "--rollout-concurrency", "1", "--console", "plain", "--lr", "1e-3",
         "--rollout-router", "builtin", "--num-rollout", "3", "--save-interval", "1"]  # fmt: skip


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
                       "--output-dir", str(out), *FLAGS, *flags]))  # fmt: skip
    return read_metrics(out / "metrics.jsonl")


def test_a_mixture_run_reports_each_source_and_each_reward(mixture_run):
    *_, records = mixture_run
    assert [r["rollout_id"] for r in records] == [0, 1, 2]
    draws = {"max": 0.0, "words": 0.0}
    for record in records:
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
    assert [r["rollout_id"] for r in resumed] == [0, 1, 2]
    # Every non-timing value of the rerun rollout, per source and reward included, to the bit.
    assert compare_records([records[2]], [resumed[2]], ignore=["^check/"]) == []
