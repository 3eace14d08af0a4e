"""Compare two runs' `metrics.jsonl` on every value that is not a timing: the proof that a
restructuring changed nothing (seeded runs of miles are deterministic).

    python tools/compare_runs.py BEFORE AFTER [--ignore REGEX ...]

BEFORE and AFTER are two `metrics.jsonl` files, or two folders: then every `metrics.jsonl` below
BEFORE is compared with the one at the same place below AFTER. Records are paired in order and
must name the same rollout. A value is a timing when its key is under `startup/` or `time/`, or
ends in `_s` (seconds) or `_per_s` (a rate): those differ between any two runs. Every other value
must be equal to the bit (NaN equals NaN), and a key on one side only is a difference too. Exit
status 0: identical; 1: differences, each printed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TIMING_PREFIXES = ("startup/", "time/")
TIMING_SUFFIXES = ("_s", "_per_s")
_MISSING = object()


@dataclass(frozen=True)
class Difference:
    """One value that is not the same in both runs."""

    where: str  # file and record, e.g. "grpo/metrics.jsonl record 3 (rollout 2)"
    key: str
    before: Any
    after: Any

    def __str__(self) -> str:
        show = lambda v: "(absent)" if v is _MISSING else repr(v)  # noqa: E731
        return f"{self.where}: {self.key}: {show(self.before)} -> {show(self.after)}"


def is_timing(key: str) -> bool:
    """Seconds, rates and start-up clocks: they differ between any two runs."""
    return key.startswith(TIMING_PREFIXES) or key.endswith(TIMING_SUFFIXES)


def _same(before: Any, after: Any) -> bool:
    if isinstance(before, float) and isinstance(after, float):
        return before == after or (math.isnan(before) and math.isnan(after))
    return type(before) is type(after) and before == after


def compare_records(
    before: Sequence[dict[str, Any]],
    after: Sequence[dict[str, Any]],
    *,
    name: str = "metrics.jsonl",
    ignore: Iterable[str] = (),
) -> list[Difference]:
    """Every non-timing difference between two runs' records (paired in order); `ignore`:
    regular expressions of further keys to leave out."""
    ignored = [re.compile(pattern) for pattern in ignore]
    differences = []
    if len(before) != len(after):
        differences.append(Difference(name, "(records)", len(before), len(after)))
    for position, (old, new) in enumerate(zip(before, after, strict=False)):
        where = f"{name} record {position} (rollout {old.get('rollout_id')})"
        for key in sorted(set(old) | set(new)):
            if is_timing(key) or any(pattern.search(key) for pattern in ignored):
                continue
            value_before, value_after = old.get(key, _MISSING), new.get(key, _MISSING)
            if value_before is _MISSING or value_after is _MISSING:
                differences.append(Difference(where, key, value_before, value_after))
            elif not _same(value_before, value_after):
                differences.append(Difference(where, key, value_before, value_after))
    return differences


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare_paths(before: Path, after: Path, *, ignore: Iterable[str] = ()) -> list[Difference]:
    """Two `metrics.jsonl` files, or two folders of them (paired by relative path)."""
    ignore = list(ignore)
    if before.is_file():
        return compare_records(read_records(before), read_records(after), ignore=ignore)
    found = sorted(p.relative_to(before) for p in before.rglob("metrics.jsonl"))
    if not found:
        raise FileNotFoundError(f"no metrics.jsonl below {before}")
    differences = []
    for relative in found:
        if not (after / relative).is_file():
            differences.append(Difference(str(relative), "(file)", "present", _MISSING))
            continue
        differences += compare_records(
            read_records(before / relative), read_records(after / relative),
            name=str(relative), ignore=ignore,
        )  # fmt: skip
    return differences


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument(
        "--ignore", action="append", default=[], metavar="REGEX",
        help="also leave out keys matching REGEX (repeatable)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    differences = compare_paths(args.before, args.after, ignore=args.ignore)
    for difference in differences:
        print(difference)
    print(f"{len(differences)} non-timing differences" if differences else "identical")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
