"""The `miles` console script as a user runs it."""

import subprocess
import sys
from importlib.metadata import version

import pytest

from miles.cli.main import installed_wheel_versions, main


def _run_console_script(*args):
    # The console script lives beside the interpreter of this environment.
    script = f"{sys.prefix}/bin/miles"
    return subprocess.run([script, *args], capture_output=True, text=True, timeout=120)


def test_console_script_prints_version():
    result = _run_console_script("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"miles {version('miles')}"


def test_bare_command_prints_help_listing_subcommands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: miles" in out and "info" in out


def test_info_reports_device_and_installed_wheels(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "device: cpu x1 (distributed backend: gloo)" in out
    assert f"wheel: miles {version('miles')}" in out
    assert "miles-training-utils" in installed_wheel_versions()


def test_unknown_subcommand_exits_with_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["trian"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'trian'" in capsys.readouterr().err


def test_train_help_lists_the_run_settings(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--rollout-batch-size" in out and "backend settings" in out


def test_train_with_a_misspelled_flag_exits_2_with_a_suggestion(capsys):
    status = main(
        ["train", "--hf-checkpoint", "c", "--prompt-data", "d", "--rollout-batchsize", "4"]
    )
    assert status == 2
    assert "did you mean '--rollout-batch-size'" in capsys.readouterr().err


def test_a_failed_run_prints_its_cause_first_and_keeps_the_traceback(
    capsys, monkeypatch, tmp_path, tiny_checkpoint
):
    import miles.train
    from miles.ray.train_group import TrainRankError

    cause = "train rank 1 of 2 (pid 4242 on node 10.0.0.7) died in train (rollout 3): gone"

    # Stands in for a run whose rank died: the report is under test.
    def failing_run(config, *, stop=None):
        raise TrainRankError(cause)

    monkeypatch.setattr(miles.train, "train", failing_run)
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    out = tmp_path / "out"
    argv = ["train", "--hf-checkpoint", str(tiny_checkpoint), "--prompt-data", str(data),
            "--rollout-batch-size", "1", "--output-dir", str(out)]  # fmt: skip
    assert main(argv) == 1
    assert main(argv) == 1  # a second failure is appended, not written over the first
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"miles train: failed: TrainRankError: {cause}"
    assert err[1] == f"(full traceback: {out / 'failure.log'})"
    log = (out / "failure.log").read_text()
    assert log.count("=== ") == 2 and log.count("Traceback (most recent call last)") == 2
