"""Fixtures for repository-tool tests: a scratch copy of the workspace's package metadata."""

import shutil
from pathlib import Path

import pytest

from tools.workspace import REPO_ROOT


@pytest.fixture
def workspace_copy(tmp_path: Path) -> Path:
    """Packages (pyproject, README, src, tests) and CODEOWNERS copied to a scratch root."""
    for pkg in (REPO_ROOT / "packages").iterdir():
        if not (pkg / "pyproject.toml").is_file():
            continue
        target = tmp_path / "packages" / pkg.name
        shutil.copytree(pkg / "src", target / "src", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(pkg / "pyproject.toml", target / "pyproject.toml")
    for name in ("CODEOWNERS", "noxfile.py"):
        shutil.copy(REPO_ROOT / name, tmp_path / name)
    for name in ("docker", ".github"):
        shutil.copytree(REPO_ROOT / name, tmp_path / name)
    return tmp_path
