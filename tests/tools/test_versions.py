"""One version for every wheel, exact sibling pins, and the tool that moves them together."""

import tomllib

import pytest

from tools.bump_version import bump, check_versions
from tools.workspace import REPO_ROOT, packages


def test_every_package_and_sibling_pin_agree():
    assert check_versions(REPO_ROOT) == []


def test_bump_rewrites_every_version_and_pin(workspace_copy):
    changed = bump("0.2.0rc1", workspace_copy)
    assert len(changed) == len(packages(workspace_copy))
    assert check_versions(workspace_copy) == []
    fsdp = tomllib.loads((workspace_copy / "packages/miles-fsdp/pyproject.toml").read_text())
    assert fsdp["project"]["version"] == "0.2.0rc1"
    assert (
        "miles-training-utils[cuda]==0.2.0rc1" in fsdp["project"]["optional-dependencies"]["cuda"]
    )
    utils = tomllib.loads(
        (workspace_copy / "packages/miles-training-utils/pyproject.toml").read_text()
    )
    assert "torch>=2.6" in utils["project"]["dependencies"]  # third-party requirements untouched


def test_hand_edited_pin_is_caught(workspace_copy):
    path = workspace_copy / "packages/miles-sglang/pyproject.toml"
    path.write_text(
        path.read_text().replace('"miles-training-utils==0.1.0"', '"miles-training-utils>=0.1.0"')
    )
    problems = check_versions(workspace_copy)
    assert problems and "miles-sglang requires 'miles-training-utils>=0.1.0'" in problems[0]


def test_diverging_package_version_is_caught(workspace_copy):
    path = workspace_copy / "packages/miles-megatron/pyproject.toml"
    path.write_text(path.read_text().replace('version = "0.1.0"', 'version = "0.1.1"', 1))
    assert any("packages disagree on the version" in p for p in check_versions(workspace_copy))


def test_bump_rejects_a_non_pep440_version(workspace_copy):
    with pytest.raises(SystemExit, match=r"'2\.x' is not a PEP 440 version"):
        bump("2.x", workspace_copy)
