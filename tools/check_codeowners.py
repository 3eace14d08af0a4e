"""Check CODEOWNERS: catch-all first, an owner line for every package, no rule shadowed by a later
broader one (GitHub applies the last match), and every path it names exists.

Rules are kept to what this check understands exactly: `*` and anchored paths (`/dir/`, `/file`).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.workspace import REPO_ROOT, packages

_OWNER = re.compile(r"^@[\w.-]+(/[\w.-]+)?$|^[^@\s]+@[^@\s]+$")


@dataclass(frozen=True)
class Rule:
    line: int
    pattern: str
    owners: tuple[str, ...]

    @property
    def path(self) -> str:
        """The anchored path without slashes at the ends; "" for the catch-all."""
        return "" if self.pattern == "*" else self.pattern.strip("/")

    def covers(self, other: Rule) -> bool:
        """True when every file `other` matches is matched by this rule too."""
        if self.pattern == "*":
            return True
        if other.pattern == "*":
            return False
        mine, theirs = self.path.split("/"), other.path.split("/")
        return theirs[: len(mine)] == mine


def parse(text: str) -> tuple[list[Rule], list[str]]:
    rules, problems = [], []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        pattern, *owners = line.split()
        if pattern != "*" and (not pattern.startswith("/") or any(c in pattern for c in "*?[!")):
            problems.append(
                f"line {number}: pattern {pattern!r} is neither '*' nor an anchored path like /dir/"
            )
            continue
        if not owners:
            problems.append(f"line {number}: {pattern} has no owner; add a team like @org/team")
        for owner in owners:
            if not _OWNER.match(owner):
                problems.append(f"line {number}: {owner!r} is not an @user, @org/team or email")
        rules.append(Rule(number, pattern, tuple(owners)))
    return rules, problems


def check(root: Path = REPO_ROOT) -> list[str]:
    path = root / "CODEOWNERS"
    if not path.is_file():
        return ["CODEOWNERS is missing at the repository root"]
    rules, problems = parse(path.read_text())
    if not rules or rules[0].pattern != "*":
        problems.append("the first rule must be the catch-all '*', so that later rules refine it")
    for index, rule in enumerate(rules):
        for later in rules[index + 1 :]:
            if later.covers(rule):
                problems.append(
                    f"line {rule.line}: {rule.pattern} is shadowed by the broader {later.pattern} on "
                    f"line {later.line} (last match wins); move the broader rule above it"
                )
        if rule.path and not (root / rule.path).exists():
            problems.append(f"line {rule.line}: {rule.pattern} names a path that does not exist")
    patterns = {rule.path for rule in rules}
    for pkg in packages(root).values():
        relative = pkg.root.relative_to(root).as_posix()
        if relative not in patterns:
            problems.append(f"package {pkg.name} has no owner line; add: /{relative}/ @org/team")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO_ROOT)
    args = parser.parse_args(argv)
    problems = check(args.root)
    for problem in problems:
        print(f"CODEOWNERS {problem}", file=sys.stderr)
    if not problems:
        print("CODEOWNERS: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
