"""The workspace's packages as data: names, versions, in-house dependencies and owned modules.

Every repo tool reads the layout from here, so a moved or added package needs no tool edits.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import tomllib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parent.parent
NAMESPACE_LEVELS = (("miles",), ("miles", "backends"))
_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def requirement_name(requirement: str) -> str:
    """`miles-sglang[cuda]==0.1.0` -> `miles-sglang`."""
    match = _REQUIREMENT_NAME.match(requirement)
    if match is None:
        raise ValueError(f"cannot read a package name from requirement {requirement!r}")
    return match.group(1).lower().replace("_", "-")


@dataclass(frozen=True)
class Package:
    """One wheel of the workspace, read from `packages/<dir>/pyproject.toml`."""

    root: Path

    @cached_property
    def pyproject(self) -> dict:
        return tomllib.loads((self.root / "pyproject.toml").read_text())

    @property
    def name(self) -> str:
        return self.pyproject["project"]["name"]

    @property
    def version(self) -> str:
        return self.pyproject["project"]["version"]

    @property
    def requirements(self) -> list[str]:
        """Runtime requirements, including those of every extra."""
        project = self.pyproject["project"]
        extras = project.get("optional-dependencies", {})
        return list(project.get("dependencies", [])) + [r for reqs in extras.values() for r in reqs]

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def modules(self) -> list[str]:
        """Dotted names of the top packages and modules this wheel owns below the namespace
        levels (`miles.config`, and module files such as `miles.train`)."""
        owned = []
        for level in NAMESPACE_LEVELS:
            level_dir = self.src.joinpath(*level)
            if not level_dir.is_dir():
                continue
            for child in sorted(level_dir.iterdir()):
                if (child / "__init__.py").is_file():
                    owned.append(".".join((*level, child.name)))
                elif child.suffix == ".py" and child.name != "__init__.py":
                    owned.append(".".join((*level, child.stem)))
        return owned


def packages(root: Path = REPO_ROOT) -> dict[str, Package]:
    """Workspace packages by distribution name."""
    found = [Package(p.parent) for p in sorted((root / "packages").glob("*/pyproject.toml"))]
    return {p.name: p for p in found}


def in_house_dependencies(package: Package, names: set[str]) -> set[str]:
    """Sibling wheels `package` declares, in its base dependencies or any extra."""
    return {requirement_name(r) for r in package.requirements} & names - {package.name}


def module_owner(module: str, owners: dict[str, str]) -> str | None:
    """The package owning dotted `module`, by longest matching owned prefix."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        owner = owners.get(".".join(parts[:end]))
        if owner is not None:
            return owner
    return None


def module_owners(root: Path = REPO_ROOT) -> dict[str, str]:
    """Owned module prefix -> distribution name, for every package."""
    return {module: pkg.name for pkg in packages(root).values() for module in pkg.modules}


@functools.cache
def load_noxfile(root: Path = REPO_ROOT) -> ModuleType:
    """The repository's noxfile as a module (its sessions' constants: DEVICES, DIST, ...)."""
    spec = importlib.util.spec_from_file_location("noxfile", root / "noxfile.py")
    assert spec is not None and spec.loader is not None, f"no noxfile.py in {root}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
