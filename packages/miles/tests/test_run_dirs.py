"""A run never starts fresh by accident and never overwrites another run's records: the checks on
--load, --output-dir and --hf-checkpoint, in-process and through `miles train` as a user runs it
(which must fail in seconds, before Ray starts)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import load_config
from miles.utils.checkpoint_layout import POINTER_FILE
from miles.utils.run_dirs import RunDirectoryError, checkpoint_to_resume, claim_output_dir
from miles.utils.tracking import METRICS_FILE, read_metrics


def _metrics(directory: Path, rollouts: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / METRICS_FILE
    path.write_text("".join(json.dumps({"rollout_id": i, "x": i}) + "\n" for i in range(rollouts)))
    return path


def test_a_load_directory_that_does_not_exist_is_refused_naming_it_and_the_fix(tmp_path):
    typo = tmp_path / "chekpoints"
    with pytest.raises(RunDirectoryError) as error:
        checkpoint_to_resume(str(typo), str(tmp_path / "checkpoints"))
    message = str(error.value)
    assert f"--load {typo} does not exist" in message
    assert "drop --load to start fresh" in message


def test_a_load_directory_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(RunDirectoryError, match=f"no {POINTER_FILE} file"):
        checkpoint_to_resume(str(tmp_path), None)


def test_only_a_save_directory_without_a_checkpoint_starts_fresh_and_says_so(tmp_path, caplog):
    save = str(tmp_path / "new")
    with caplog.at_level(logging.INFO, logger="miles.utils.run_dirs"):
        assert checkpoint_to_resume(save, save) is None  # --load defaults to --save
    assert f"starting fresh: --save {save} holds no checkpoint yet" in caplog.text
    assert checkpoint_to_resume(None, None) is None


def test_a_checkpoint_pointer_is_the_rollout_to_resume_from(tmp_path):
    (tmp_path / "iter_0000003").mkdir()  # a checkpoint of an older miles: no manifest
    (tmp_path / "iter_0000003" / "meta.json").write_text("{}")
    (tmp_path / POINTER_FILE).write_text("3")
    assert checkpoint_to_resume(str(tmp_path), None) == 3
    assert checkpoint_to_resume(str(tmp_path), str(tmp_path)) == 3


def test_a_fresh_run_refuses_an_output_dir_with_another_runs_metrics(tmp_path):
    metrics = _metrics(tmp_path, rollouts=3)
    before = metrics.read_text()
    with pytest.raises(RunDirectoryError) as error:
        claim_output_dir(str(tmp_path), resuming=False, overwrite=False)
    assert "3 records, rollouts 0..2" in str(error.value)
    assert "--overwrite-output-dir" in str(error.value)
    assert metrics.read_text() == before


def test_overwrite_keeps_the_old_metrics_beside_and_a_resumed_run_keeps_its_own(tmp_path):
    metrics = _metrics(tmp_path, rollouts=2)
    claim_output_dir(str(tmp_path), resuming=True, overwrite=False)  # its own records: allowed
    assert metrics.is_file()
    claim_output_dir(str(tmp_path), resuming=False, overwrite=True)
    assert not metrics.exists()
    (kept,) = tmp_path.glob("metrics.replaced-*.jsonl")
    assert [r["rollout_id"] for r in read_metrics(kept)] == [0, 1]
    metrics.write_text("")  # an empty file holds nothing to lose
    claim_output_dir(str(tmp_path), resuming=False, overwrite=False)


@pytest.mark.parametrize("path", ["/no/such/ckpt", "./missing", "~/missing-ckpt", "a/b/c"])
def test_a_missing_hf_checkpoint_path_is_a_config_error(path):
    with pytest.raises(ValueError, match="no such directory"):
        load_config(["--hf-checkpoint", path, "--prompt-data", "d.jsonl",
                     "--rollout-batch-size", "2"])  # fmt: skip


def test_a_hub_id_is_left_to_transformers():
    config = load_config(["--hf-checkpoint", "Qwen/Qwen3-0.6B", "--prompt-data", "d.jsonl",
                          "--rollout-batch-size", "2"])  # fmt: skip
    assert config.checkpoint.hf_checkpoint == "Qwen/Qwen3-0.6B"


def _miles_train(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    checkpoint = tmp_path / "ckpt"  # never read: the checks come first
    checkpoint.mkdir(exist_ok=True)
    script = f"{sys.prefix}/bin/miles"
    return subprocess.run(
        [script, "train", "--hf-checkpoint", str(checkpoint), "--prompt-data", "d.jsonl",
         "--rollout-batch-size", "2", "--output-dir", str(tmp_path / "out"), *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_miles_train_with_a_load_typo_exits_2_with_one_line_before_ray_starts(tmp_path):
    result = _miles_train(tmp_path, "--load", str(tmp_path / "chekpoints"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"miles train: error: --load {tmp_path / 'chekpoints'} does not exist; name the --save "
        "directory of the run to resume, or drop --load to start fresh"
    ]
    assert "ray" not in result.stdout.lower()


def test_miles_train_into_another_runs_output_dir_exits_2_and_leaves_it_alone(tmp_path):
    metrics = _metrics(tmp_path / "out", rollouts=5)
    before = metrics.read_text()
    result = _miles_train(tmp_path)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"miles train: error: --output-dir {tmp_path / 'out'} holds")
    assert metrics.read_text() == before
