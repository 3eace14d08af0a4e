"""A custom reward for the eval-config tests: a score no built-in reward gives, so a metric shows
which reward scored a dataset."""

from __future__ import annotations

from miles.backends.training_utils.batching.sample import Sample

MARK = -1.0


def marked(sample: Sample) -> float:
    return MARK
