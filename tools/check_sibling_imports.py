"""Fail when a package imports a sibling wheel that it does not declare as a dependency.

All miles wheels share the `miles` namespace, so generic checkers (deptry) cannot tell which wheel
an `import miles...` needs. This check maps each imported module to the package that owns it and
requires that package among the importer's declared dependencies (base or extras). Tests count:
they run in an environment holding only their package and what it declares.

    python tools/check_sibling_imports.py [--root REPO]
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.workspace import REPO_ROOT, in_house_dependencies, module_owner, module_owners, packages

NAMESPACES = ("miles", "miles.backends")


def imported_modules(source: str, filename: str) -> Iterator[tuple[int, str]]:
    """(line, dotted module) for each absolute import in `source`."""
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                # `from miles.backends import fsdp_utils` imports the subpackage, not the level.
                yield node.lineno, f"{node.module}.{alias.name}"


def find_violations(root: Path) -> list[str]:
    pkgs = packages(root)
    owners = module_owners(root)
    names = set(pkgs)
    violations = []
    for pkg in pkgs.values():
        allowed = in_house_dependencies(pkg, names) | {pkg.name}
        for path in sorted(pkg.root.rglob("*.py")):
            for line, module in imported_modules(path.read_text(), str(path)):
                if module.split(".")[0] != "miles":
                    continue
                owner = module_owner(module, owners)
                where = f"{path.relative_to(root)}:{line}"
                if owner is None:
                    if module not in NAMESPACES:
                        violations.append(f"{where}: imports {module}, which no package owns")
                elif owner not in allowed:
                    violations.append(
                        f"{where}: {pkg.name} imports {module} from {owner} without declaring it; "
                        f'add "{owner}=={pkgs[owner].version}" to {pkg.name}\'s dependencies '
                        "or remove the import"
                    )
    return violations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO_ROOT)
    args = parser.parse_args(argv)
    violations = find_violations(args.root)
    for violation in violations:
        print(violation, file=sys.stderr)
    if violations:
        print(f"{len(violations)} undeclared sibling import(s)", file=sys.stderr)
        return 1
    print(f"sibling imports: all declared ({len(packages(args.root))} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
