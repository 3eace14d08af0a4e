"""The observability flags are checked before anything starts: each refusal names the flag, the
value and the fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from miles.config import load_config
from miles.utils.observability.config import ObservabilityConfig


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mlflow-run-name", "x"], "--mlflow-run-name is only read with --use-mlflow"),
        (["--mlflow-tags", "team"], "--mlflow-tags takes key=value items, got 'team'"),
        (["--prometheus-port", "70000"], "--prometheus-port must be a TCP port"),
        (["--prometheus-port", "9100"], "--prometheus-port is only read with --use-prometheus"),
        (["--profile-target", "trian"], "--profile-target trian: not a profiling target"),
        (["--profile-step-end", "5"], "--profile-step-end is only read with --profile-target"),
        (["--profile-target", "train", "--profile-step-start", "2", "--profile-step-end", "2"],
         "must give rollouts start .. end - 1 with 0 <= start < end"),
        (["--profile-target", "train", "--num-rollout", "2", "--profile-step-start", "2",
          "--profile-step-end", "3"], "--profile-step-start 2 is past the run's last rollout (1"),
        (["--profile-target", "engine", "--debug-train-only", "--load-debug-rollout-data",
          "r{rollout_id}.pt"], "--profile-target engine: a run with --debug-train-only has no"),
        (["--memory-snapshot-num-steps", "3"],
         "--memory-snapshot-num-steps is only read with --memory-snapshot-dir DIR"),
    ],
)  # fmt: skip
def test_bad_observability_flags_are_refused_naming_the_flag(
    tiny_checkpoint, tmp_path, flags, message
):
    data = tmp_path / "data.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    base = ["--hf-checkpoint", str(tiny_checkpoint), "--prompt-data", str(data),
            "--rollout-batch-size", "1"]  # fmt: skip
    with pytest.raises(ValueError) as error:
        load_config([*base, *flags])
    assert message in str(error.value)


def test_everything_is_off_by_default_and_a_relative_snapshot_dir_is_made_absolute(
    tiny_checkpoint, tmp_path, monkeypatch
):
    assert not ObservabilityConfig().enabled
    data = tmp_path / "data.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    monkeypatch.chdir(tmp_path)
    config = load_config(["--hf-checkpoint", str(tiny_checkpoint), "--prompt-data", str(data),
                          "--rollout-batch-size", "1", "--memory-snapshot-dir", "mem",
                          "--profile-target", "engine", "train"])  # fmt: skip
    assert config.observability.memory_snapshot_dir == str(tmp_path / "mem")
    assert config.observability.profiles == ("train", "engine")


def test_with_everything_off_a_run_imports_no_observability_code(tiny_checkpoint, tmp_path):
    # The driver's modules and a run's config, as `miles train` reads them: neither the clients
    # (mlflow, prometheus_client) nor our modules that use them are imported.
    data = tmp_path / "data.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    lines = (
        "import sys",
        "from miles.config import load_config",
        f"load_config(['--hf-checkpoint', {str(tiny_checkpoint)!r}, '--prompt-data',",
        f"             {str(data)!r}, '--rollout-batch-size', '1'])",
        "import miles.train, miles.ray.run, miles.ray.rollout_manager, miles.cli.commands",
        "watched = ('mlflow', 'prometheus_client', 'miles.ray.observer', 'miles.ray.memory_watch',",
        "           'miles.utils.observability.sinks', 'miles.utils.observability.mlflow_tracking',",
        "           'miles.utils.observability.prometheus_metrics', 'miles.ray.rollout_profiling',",
        "           'miles.utils.observability.report')",
        "bad = [m for m in sys.modules if m.split('.')[0] in watched or m in watched]",
        "assert not bad, bad",
    )
    result = subprocess.run(
        [sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
