"""MLflow tracking against a real MLflow store (the embedded SQLite default under the output
directory), read back with `mlflow.MlflowClient`: params, metrics by rollout, artifacts, a resumed
run continuing its MLflow run, and a failed run's failure.log."""

from __future__ import annotations

from mlflow import MlflowClient

from miles.utils.failures import write_failure_log
from miles.utils.observability.config import ObservabilityConfig
from miles.utils.observability.mlflow_tracking import (
    MlflowRunRef,
    MlflowTracking,
    attach_failure_log,
    embedded_store,
)
from miles.utils.tracking import Tracker

SETTINGS = ObservabilityConfig(use_mlflow=True, mlflow_tags=["team=rl"])


def tracked_run(out, config, records, *, resuming=False, failed=False):
    sink = MlflowTracking(SETTINGS, out, run_config=config, resuming=resuming)
    tracker = Tracker(out, run_config=config, resume_from=records[0][0] if resuming else None,
                      sinks=[sink])  # fmt: skip
    for step, metrics in records:
        tracker.log(metrics, step=step)
    tracker.close(failed=failed)
    return sink.ref


def test_a_run_logs_params_metrics_by_rollout_and_artifacts_and_a_resume_continues_it(tmp_path):
    config = {"lr": 0.001, "num_rollout": 2, "eval_prompt_data": ["heldout", "/data/x.jsonl"]}
    first = tracked_run(tmp_path, config, [
        (0, {"rollout/reward_mean": 0.25, "eval/heldout/pass@1": 0.5, "note": "text"}),
        (1, {"rollout/reward_mean": 0.5}),
    ])  # fmt: skip
    assert first.tracking_uri == embedded_store(tmp_path)  # no server: SQLite in the run dir
    assert (tmp_path / "mlflow" / "mlflow.db").is_file()
    client = MlflowClient(tracking_uri=first.tracking_uri)
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert run.data.params["lr"] == "0.001"
    assert run.data.params["eval_prompt_data"] == '["heldout", "/data/x.jsonl"]'
    assert run.data.tags["team"] == "rl"
    history = client.get_metric_history(first.run_id, "rollout/reward_mean")
    assert [(m.step, m.value) for m in history] == [(0, 0.25), (1, 0.5)]
    assert client.get_metric_history(first.run_id, "eval/heldout/pass_at_1")[0].value == 0.5
    artifacts = {a.path for a in client.list_artifacts(first.run_id)}
    assert {"config.json", "plots"} <= artifacts
    assert "plots/reward.png" in {a.path for a in client.list_artifacts(first.run_id, "plots")}

    # Resumed at rollout 2 with a longer run: the same MLflow run, the changed setting a tag.
    resumed = tracked_run(tmp_path, {**config, "num_rollout": 3},
                          [(2, {"rollout/reward_mean": 0.75})], resuming=True)  # fmt: skip
    assert resumed.run_id == first.run_id
    assert len(client.search_runs([first.experiment_id])) == 1
    run = client.get_run(first.run_id)
    assert run.data.tags["miles.changed_on_resume.num_rollout"] == "2 -> 3"
    history = client.get_metric_history(first.run_id, "rollout/reward_mean")
    assert [m.step for m in history] == [0, 1, 2]


def test_a_fresh_run_in_the_same_directory_gets_a_new_mlflow_run(tmp_path):
    first = tracked_run(tmp_path, {"lr": 1}, [(0, {"x": 1.0})])
    second = tracked_run(tmp_path, {"lr": 2}, [(0, {"x": 2.0})])  # not resuming
    assert second.run_id != first.run_id
    assert MlflowRunRef.read(tmp_path) == second


def test_a_failed_run_is_marked_failed_with_its_failure_log_attached(tmp_path):
    ref = tracked_run(tmp_path, {"lr": 1}, [(0, {"x": 1.0})], failed=True)
    client = MlflowClient(tracking_uri=ref.tracking_uri)
    assert client.get_run(ref.run_id).info.status == "FAILED"
    try:
        raise RuntimeError("engine 0 at http://127.0.0.1:1 failed")
    except RuntimeError as err:
        log = write_failure_log(tmp_path, err)
    assert attach_failure_log(tmp_path, log) == ref.run_id
    assert "failure.log" in {a.path for a in client.list_artifacts(ref.run_id)}
    assert attach_failure_log(tmp_path / "elsewhere", log) is None  # that dir logged to no run
