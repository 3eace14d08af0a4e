"""CI's package selection: touched packages plus their dependents; root files select all."""

import pytest

from tools.changed_packages import select_packages

ALL = ["miles", "miles-fsdp", "miles-megatron", "miles-sglang", "miles-training-utils"]


@pytest.mark.parametrize(
    ("changed", "expected"),
    [
        (["packages/miles-training-utils/src/miles/backends/training_utils/infra/device.py"], ALL),
        (
            ["packages/miles-sglang/README.md"],
            ["miles", "miles-fsdp", "miles-megatron", "miles-sglang"],
        ),
        (["packages/miles/src/miles/cli/main.py"], ["miles", "miles-fsdp", "miles-megatron"]),
        (["packages/miles-fsdp/tests/test_package.py"], ["miles-fsdp"]),
        (
            ["packages/miles-fsdp/x.py", "packages/miles-megatron/y.py"],
            ["miles-fsdp", "miles-megatron"],
        ),
        (["uv.lock"], ALL),
        (["noxfile.py"], ALL),
        (["tools/workspace.py"], ALL),
        (["tests/e2e/test_x.py"], ALL),
        (["README.md"], []),
        (["docs/quickstart.md"], []),
        (["packages/miles-gone/src/x.py"], ALL),
    ],
)
def test_selection(changed, expected):
    assert select_packages(changed) == expected


def test_github_output_receives_the_json_list(tmp_path, monkeypatch):
    from tools.changed_packages import main

    output = tmp_path / "github_output"
    monkeypatch.setenv("GITHUB_OUTPUT", str(output))
    assert main(["packages/miles-fsdp/x.py", "--github-output", "packages"]) == 0
    assert output.read_text() == 'packages=["miles-fsdp"]\n'
