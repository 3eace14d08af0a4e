"""Which packages a change touches, plus every package that depends on them.

CI tests only these (architecture.md: "Repository layout"). A file outside `packages/` that can
change how everything builds or runs (the lock, the root pyproject, noxfile, tools, tests/e2e)
selects all packages; documentation alone selects none.

    python tools/changed_packages.py --base origin/main          # from git
    python tools/changed_packages.py packages/miles/src/x.py     # from paths
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path, PurePosixPath

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.workspace import REPO_ROOT, Package, in_house_dependencies, packages

DOC_ONLY_SUFFIXES = (".md", ".rst", ".txt")
DOC_ONLY_DIRS = ("docs",)


def _is_doc_only(path: PurePosixPath) -> bool:
    return path.parts[0] in DOC_ONLY_DIRS or (
        len(path.parts) == 1 and path.suffix in DOC_ONLY_SUFFIXES
    )


def dependents(pkgs: dict[str, Package]) -> dict[str, set[str]]:
    """name -> names of every package that depends on it, directly or transitively."""
    names = set(pkgs)
    direct = {name: in_house_dependencies(pkg, names) for name, pkg in pkgs.items()}
    result: dict[str, set[str]] = {name: set() for name in pkgs}
    for name in pkgs:
        frontier = [name]
        while frontier:
            current = frontier.pop()
            for other, deps in direct.items():
                if current in deps and other not in result[name]:
                    result[name].add(other)
                    frontier.append(other)
    return result


def select_packages(changed: list[str], root: Path = REPO_ROOT) -> list[str]:
    """Sorted names of the packages to test for a change touching `changed` (repo-relative)."""
    pkgs = packages(root)
    by_dir = {pkg.root.name: name for name, pkg in pkgs.items()}
    selected: set[str] = set()
    for raw in changed:
        path = PurePosixPath(raw)
        if not path.parts:
            continue
        if path.parts[0] == "packages" and len(path.parts) > 1:
            name = by_dir.get(path.parts[1])
            if name is None:  # a package directory that was deleted or renamed: test everything
                return sorted(pkgs)
            selected.add(name)
        elif not _is_doc_only(path):
            return sorted(pkgs)
    reverse = dependents(pkgs)
    for name in list(selected):
        selected |= reverse[name]
    return sorted(selected)


def changed_files(base: str, root: Path = REPO_ROOT) -> list[str]:
    out = subprocess.run(
        ["git", "diff", "--name-only", f"{base}...HEAD"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [line for line in out.splitlines() if line]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="changed files, relative to the repo root")
    parser.add_argument("--base", help="git revision to diff against instead of listing paths")
    parser.add_argument("--json", action="store_true", help="print a JSON list (for CI matrices)")
    parser.add_argument(
        "--github-output",
        metavar="KEY",
        help="also append KEY=<JSON list> to the file named by $GITHUB_OUTPUT (GitHub Actions)",
    )
    args = parser.parse_args(argv)
    if args.base and args.paths:
        parser.error("give either --base or paths, not both")
    changed = changed_files(args.base) if args.base else args.paths
    selected = select_packages(changed)
    print(json.dumps(selected) if args.json else "\n".join(selected))
    if args.github_output:
        output = os.environ.get("GITHUB_OUTPUT")
        if not output:
            parser.error("--github-output needs $GITHUB_OUTPUT (set by GitHub Actions)")
        with open(output, "a") as f:
            f.write(f"{args.github_output}={json.dumps(selected)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
