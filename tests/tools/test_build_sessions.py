"""Every `nox -s "build(device=...)"` session, run from the repository as a user would, passes on
this host, and leaves a complete wheelhouse: a wheel and an sdist per package, and constraints
that pin the device's own libraries and leave out what its base image provides. Each session
also installs its wheels with the device's extra into a fresh venv and runs `miles info` there
(noxfile.py); the rocm one does so with an amdsmi that cannot load, as on a host without ROCm."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tools.workspace import REPO_ROOT, load_noxfile, packages

NOXFILE = load_noxfile()

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def pins(device: str) -> set[str]:
    text = (REPO_ROOT / "dist" / device / NOXFILE.CONSTRAINTS).read_text()
    return {line.split("==")[0].split(";")[0].strip() for line in text.splitlines() if "==" in line}


@pytest.mark.parametrize("device", NOXFILE.DEVICES)
def test_the_build_session_passes_and_leaves_a_complete_wheelhouse(device):
    result = subprocess.run(
        [sys.executable, "-m", "nox", "--no-color", "-s", f"build(device='{device}')"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=1100,
    )  # fmt: skip
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    assert "device: cpu x1" in log  # `miles info` ran in the device's venv
    out = REPO_ROOT / "dist" / device
    names = {name.replace("-", "_") for name in packages()}
    assert {w.name.split("-")[0] for w in out.glob("*.whl")} == names
    assert {s.name.rsplit("-", 1)[0] for s in out.glob("*.tar.gz")} == names
    pinned = pins(device)
    assert "ray" in pinned and "transformers" in pinned
    provided_by_image = {p for p in pinned if p.startswith(("nvidia-", "cuda-"))}
    if device == "cuda":
        assert "nvidia-ml-py" in pinned and "torch" in pinned
    if device == "rocm":
        assert "torch" not in pinned and "amdsmi" not in pinned and not provided_by_image
    if device == "npu":
        assert "torch-npu" in pinned and not provided_by_image
    if device == "rocm":
        assert "amdsmi is installed but cannot load" in log
