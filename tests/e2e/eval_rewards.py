"""A custom reward for the eval-config run: a score no built-in reward gives (they score 0 to 1),
so the metrics show which reward scored which dataset."""

from __future__ import annotations

MARK = -1.0


def marked(sample) -> float:
    return MARK
