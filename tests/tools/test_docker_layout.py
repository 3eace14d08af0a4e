"""The Dockerfiles cannot be built here (no Docker engine), so check what they rely on instead:
every path they copy exists or is what `nox -s build(device=...)` writes, and every wheel and
extra they install exists in the current layout."""

import re
from pathlib import Path

import pytest

from tools.workspace import REPO_ROOT, load_noxfile, packages

NOXFILE = load_noxfile()
DOCKERFILES = sorted((REPO_ROOT / "docker").glob("Dockerfile.*"))


def _instructions(dockerfile: Path) -> list[str]:
    """Logical lines (continuations joined), comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_there_is_one_dockerfile_per_accelerator():
    assert {p.suffix.lstrip(".") for p in DOCKERFILES} == set(NOXFILE.DEVICES) - {"cpu"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copied_paths_exist_or_are_the_devices_build_output(dockerfile):
    device = dockerfile.suffix.lstrip(".")
    build_output = (NOXFILE.DIST / device).as_posix()
    copies = [line.split()[1:-1] for line in _instructions(dockerfile) if line.startswith("COPY")]
    assert copies, f"{dockerfile.name} copies nothing"
    for sources in copies:
        for source in sources:
            if source.rstrip("/") == build_output:
                continue
            assert not source.startswith("dist/"), (
                f"{dockerfile.name} copies {source}, not {build_output}/"
            )
            assert (REPO_ROOT / source).exists(), f"{dockerfile.name} copies missing {source}"
    assert any(s.rstrip("/") == build_output for srcs in copies for s in srcs)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_installed_wheels_and_extras_exist(dockerfile):
    device = dockerfile.suffix.lstrip(".")
    pkgs = packages()
    installs = [
        line for line in _instructions(dockerfile) if "pip install" in line and "/wheels" in line
    ]
    assert installs, f"{dockerfile.name} never installs the wheelhouse"
    requested = re.findall(r'"([a-z0-9-]+)\[([a-z]+)\]"', " ".join(installs))
    assert requested, f"{dockerfile.name} installs no miles wheel with a device extra"
    for name, extra in requested:
        assert name in pkgs, f"{dockerfile.name} installs {name}, which is not a workspace package"
        extras = pkgs[name].pyproject["project"].get("optional-dependencies", {})
        assert extra == device and extra in extras, f"{dockerfile.name}: {name}[{extra}]"
    assert f"--constraint /wheels/{NOXFILE.CONSTRAINTS}" in " ".join(installs)


def test_amd_smi_comes_from_the_rocm_image_not_from_pypi():
    # The [rocm] extras pull no amdsmi (PyPI's carries no library and breaks `import ray` where
    # ROCm is missing); the ROCm Dockerfile installs the image's own, version-matched bindings.
    for name, package in packages().items():
        rocm = package.pyproject["project"].get("optional-dependencies", {}).get("rocm", [])
        assert not [r for r in rocm if r.startswith("amdsmi")], f"{name}[rocm] pulls amdsmi"
    rocm_file = REPO_ROOT / "docker" / "Dockerfile.rocm"
    assert any(NOXFILE.ROCM_AMDSMI in line for line in _instructions(rocm_file) if "RUN" in line)
    assert NOXFILE.BASE_IMAGE_PROVIDES["rocm"].match("amdsmi==7.0.2")
