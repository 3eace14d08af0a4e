"""Metrics sinks (JSONL, TensorBoard, W&B offline), `miles plot`, and the console view."""

from __future__ import annotations

import json

import pytest

from miles.cli.main import main
from miles.utils.console import ConsoleView
from miles.utils.tracking import METRICS_FILE, JsonlWriter, Tracker, read_metrics


def test_jsonl_records_every_step_and_writes_nan_as_null(tmp_path):
    tracker = Tracker(tmp_path, run_config={"lr": 1e-3})
    tracker.log({"rollout/reward_mean": 0.5, "train/loss": float("nan")}, step=0)
    tracker.log({"rollout/reward_mean": 0.75}, step=1)
    tracker.close()
    records = read_metrics(tmp_path / METRICS_FILE)
    assert records == [
        {"rollout_id": 0, "rollout/reward_mean": 0.5, "train/loss": None},
        {"rollout_id": 1, "rollout/reward_mean": 0.75},
    ]
    assert json.loads((tmp_path / "config.json").read_text()) == {"lr": 1e-3}


def test_resuming_moves_records_from_the_resume_point_on_into_a_file_of_their_own(tmp_path):
    writer = JsonlWriter(tmp_path / METRICS_FILE)
    for step in range(4):
        writer.log({"rollout_id": step, "x": step})
    writer.close()
    resumed = JsonlWriter(tmp_path / METRICS_FILE, resume_from=2)
    resumed.log({"rollout_id": 2, "x": 20})
    resumed.close()
    assert [r["x"] for r in read_metrics(tmp_path / METRICS_FILE)] == [0, 1, 20]
    (dropped,) = tmp_path.glob("metrics.dropped-*.jsonl")
    assert [r["x"] for r in read_metrics(dropped)] == [2, 3]  # nothing written is lost
    JsonlWriter(tmp_path / METRICS_FILE, resume_from=1).close()  # a second resume, same second
    assert len(list(tmp_path.glob("metrics.dropped-*.jsonl"))) == 2
    JsonlWriter(tmp_path / METRICS_FILE, resume_from=1).close()  # nothing past it: no new file
    assert len(list(tmp_path.glob("metrics.dropped-*.jsonl"))) == 2


def test_a_torn_last_line_is_skipped(tmp_path, caplog):
    path = tmp_path / METRICS_FILE
    path.write_text('{"rollout_id": 0, "x": 1}\n{"rollout_id": 1, "x"')
    assert read_metrics(path) == [{"rollout_id": 0, "x": 1}]
    assert "not JSON" in caplog.text


def test_tensorboard_events_are_written(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(tmp_path, use_tensorboard=True)
    for step in range(3):
        tracker.log({"rollout/reward_mean": step / 2}, step=step)
    tracker.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    values = [e.value for e in events.Scalars("rollout/reward_mean")]
    assert values == pytest.approx([0.0, 0.5, 1.0])


def test_wandb_offline_run_needs_no_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    tracker = Tracker(
        tmp_path, use_wandb=True, wandb_mode="offline", wandb_project="miles-test",
        run_config={"seed": 1},
    )  # fmt: skip
    tracker.log({"rollout/reward_mean": 0.25}, step=0)
    tracker.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_miles_plot_writes_one_png_per_panel_with_data(tmp_path, capsys):
    tracker = Tracker(tmp_path)
    for step in range(5):
        tracker.log(
            {
                "rollout/reward_mean": step / 4,
                "train/loss": 1 - step / 4,
                "time/generate_s": 0.5,
                "time/train_s": 0.25,
                **({"eval/heldout/reward_mean": step / 5} if step % 2 == 0 else {}),
            },
            step=step,
        )
    tracker.close()
    assert main(["plot", str(tmp_path)]) == 0
    written = {p.name for p in (tmp_path / "plots").iterdir()}
    assert written == {"reward.png", "eval.png", "loss.png", "time.png"}
    assert all((tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG" for name in written)
    assert "reward.png" in capsys.readouterr().out


def test_miles_plot_explains_a_directory_without_metrics(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_plain_console_prints_one_line_per_rollout(capsys):
    view = ConsoleView(num_rollout=3, mode="plain")
    view.update("generate", 0)
    view.record(0, {"rollout/reward_mean": 0.5, "time/train_s": 1.25, "ignored": 3})
    view.close()
    line = capsys.readouterr().out.strip()
    assert line == "[miles] rollout 1/3: reward 0.5, train s 1.25"


def test_rich_console_renders_phase_and_counters():
    from rich.console import Console

    view = ConsoleView(num_rollout=10, mode="plain")
    view.update("train", 4)
    view.latest = {"rollout/reward_mean": 0.75}
    console = Console(record=True, width=80)
    console.print(view._render())
    text = console.export_text()
    assert "miles: train" in text and "5/10" in text and "0.75" in text
