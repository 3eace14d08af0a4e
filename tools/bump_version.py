"""Set one version on every wheel and every sibling pin: `python tools/bump_version.py 0.2.0`.

miles ships all wheels at one version with exact sibling pins (architecture.md: "Repository
layout"), so a release is one command. `check_versions` is what the test suite runs to catch a
hand edit that broke the rule.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from packaging.version import InvalidVersion, Version

from tools.workspace import REPO_ROOT, packages, requirement_name

_VERSION_LINE = re.compile(r'^(version\s*=\s*")[^"]*(")', re.MULTILINE)


def _pin_pattern(name: str) -> re.Pattern[str]:
    # "miles-sglang==0.1.0" or "miles-sglang[cuda]==0.1.0" inside a quoted requirement.
    return re.compile(rf'("{re.escape(name)}(?:\[[^\]]*\])?==)[^"]*(")')


def bump(new_version: str, root: Path = REPO_ROOT) -> list[Path]:
    """Rewrite every package version and sibling pin to `new_version`; returns the files changed."""
    try:
        Version(new_version)
    except InvalidVersion as err:
        raise SystemExit(f"{new_version!r} is not a PEP 440 version (e.g. 0.2.0): {err}") from None
    pkgs = packages(root)
    changed = []
    for pkg in pkgs.values():
        path = pkg.root / "pyproject.toml"
        text = path.read_text()
        new = _VERSION_LINE.sub(rf"\g<1>{new_version}\g<2>", text, count=1)
        for sibling in pkgs:
            new = _pin_pattern(sibling).sub(rf"\g<1>{new_version}\g<2>", new)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


def check_versions(root: Path = REPO_ROOT) -> list[str]:
    """Disagreements between package versions and sibling pins; empty when consistent."""
    pkgs = packages(root)
    versions = {pkg.version for pkg in pkgs.values()}
    problems = []
    if len(versions) != 1:
        listing = ", ".join(f"{p.name}={p.version}" for p in pkgs.values())
        problems.append(f"packages disagree on the version: {listing}")
    for pkg in pkgs.values():
        for requirement in pkg.requirements:
            name = requirement_name(requirement)
            if name not in pkgs or name == pkg.name:
                continue
            expected = f"=={pkgs[name].version}"
            if not requirement.replace(" ", "").endswith(expected):
                problems.append(
                    f"{pkg.name} requires {requirement!r}; sibling pins must be exact: {name}...{expected}"
                )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version", help="the new version for every wheel, e.g. 0.2.0")
    parser.add_argument("--root", type=Path, default=REPO_ROOT)
    args = parser.parse_args(argv)
    for path in bump(args.version, args.root):
        print(f"updated {path.relative_to(args.root)}")
    problems = check_versions(args.root)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"all packages at {args.version}; run `uv lock` to refresh the lock file")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
