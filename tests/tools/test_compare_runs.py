"""tools/compare_runs.py: the check that a restructuring changed no value of a seeded run."""

import json
import math

from tools.compare_runs import compare_paths, compare_records, is_timing, main

RECORD = {
    "rollout_id": 0, "train/loss": 0.25, "train/grad_norm": 1.5, "rollout/reward_mean": math.nan,
    "eval/heldout/pass@1": 0.5, "time/step_s": 0.31, "startup/began_at": 1.7e9,
    "rollout/samples_per_s": 812.0, "async/trainer_wait_s": 0.02,
}  # fmt: skip


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_timings_differ_between_runs_and_are_left_out():
    assert all(map(is_timing, ("time/step_s", "startup/began_at", "rollout/samples_per_s",
                               "async/trainer_wait_s", "rollout/generate_time_s")))  # fmt: skip
    assert not any(map(is_timing, ("train/loss", "rollout/reward_mean", "async/staleness_max")))
    later = {**RECORD, "time/step_s": 9.0, "startup/began_at": 2e9, "rollout/samples_per_s": 1.0,
             "async/trainer_wait_s": 3.0}  # fmt: skip
    assert compare_records([RECORD], [later]) == []


def test_nan_equals_nan_and_every_other_value_must_match_to_the_bit():
    assert compare_records([RECORD], [dict(RECORD)]) == []
    nudged = {**RECORD, "train/loss": math.nextafter(0.25, 1.0)}
    (difference,) = compare_records([RECORD], [nudged])
    assert difference.key == "train/loss" and difference.after == math.nextafter(0.25, 1.0)
    # An int where a float was is a change of what was logged, too.
    (difference,) = compare_records([RECORD], [{**RECORD, "train/grad_norm": 1}])
    assert difference.key == "train/grad_norm"


def test_a_key_or_a_record_on_one_side_only_is_a_difference():
    (dropped,) = compare_records([RECORD], [{k: v for k, v in RECORD.items() if k != "train/loss"}])
    assert dropped.key == "train/loss" and "(absent)" in str(dropped)
    (extra,) = compare_records([RECORD], [RECORD, RECORD])
    assert extra.key == "(records)" and (extra.before, extra.after) == (1, 2)
    assert compare_records([RECORD], [{**RECORD, "new/metric": 1.0}], ignore=["^new/"]) == []


def test_folders_are_compared_file_by_file_and_the_exit_status_says_which(tmp_path, capsys):
    for run in ("before", "after"):
        _write(tmp_path / run / "sft/metrics.jsonl", [RECORD])
        _write(tmp_path / run / "grpo/metrics.jsonl", [RECORD, {**RECORD, "rollout_id": 1}])
    assert compare_paths(tmp_path / "before", tmp_path / "after") == []
    assert main([str(tmp_path / "before"), str(tmp_path / "after")]) == 0
    _write(tmp_path / "after/grpo/metrics.jsonl", [RECORD, {**RECORD, "rollout_id": 1,
                                                            "train/loss": 0.5}])  # fmt: skip
    assert main([str(tmp_path / "before"), str(tmp_path / "after")]) == 1
    printed = capsys.readouterr().out
    assert "grpo/metrics.jsonl record 1 (rollout 1): train/loss: 0.25 -> 0.5" in printed
    assert "1 non-timing differences" in printed
