"""A guide's code blocks, read from the page, so each guide's test runs what the page shows.

A runnable block names its file on its first line (`# my_rewards.py`); a block that is an addition
to a miles module names that module (`# algorithms/loss.py`).
"""

from __future__ import annotations

import re
from pathlib import Path

GUIDES = Path(__file__).resolve().parents[2] / "docs/guides"


def blocks(guide: str, language: str = "python") -> list[str]:
    """Every fenced `language` block of docs/guides/`guide`, in page order."""
    text = (GUIDES / guide).read_text()
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def block(guide: str, name: str, *, language: str = "python", containing: str = "") -> str:
    """The one block of the guide that opens with `# {name}` (and holds `containing`)."""
    found = [
        b
        for b in blocks(guide, language)
        if re.match(rf"# {re.escape(name)}(\s|$)", b) and containing in b
    ]
    assert len(found) == 1, (
        f"docs/guides/{guide} has {len(found)} {language} blocks opening with '# {name}'"
        + (f" and holding {containing!r}" if containing else "")
        + "; expected exactly one"
    )
    return found[0]


def write_modules(guide: str, names: list[str], directory: Path) -> None:
    """Write the guide's blocks `names` (paths such as `my_pkg/engine.py`) under `directory`."""
    for name in names:
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block(guide, name))
