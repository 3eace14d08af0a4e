"""Dynamic-sampling filters: after a group is scored, decide whether training keeps it.

A filter is `fn(group: list[Sample]) -> bool` (True keeps the group); the flag
`--dynamic-sampling-filter-path` names a built-in from `BUILTIN_FILTERS` or an import path.
"""

from __future__ import annotations

from collections.abc import Callable

from miles.backends.training_utils.batching.sample import Sample
from miles.backends.training_utils.infra.import_path import load_function, split_import_path

FILTER_FLAG = "--dynamic-sampling-filter-path"

GroupFilter = Callable[[list[Sample]], bool]


def nonzero_std(group: list[Sample]) -> bool:
    """Keep a group only if its rewards differ: with equal rewards every GRPO advantage is zero,
    so the group costs a training step and teaches nothing (DAPO's dynamic sampling)."""
    rewards = [sample.reward for sample in group]
    if any(reward is None for reward in rewards):
        missing = [sample.index for sample in group if sample.reward is None]
        raise ValueError(
            f"{FILTER_FLAG} nonzero_std: samples {missing} have no reward; the group must be "
            "scored before it is filtered"
        )
    return max(rewards) != min(rewards)  # type: ignore[type-var]


BUILTIN_FILTERS: dict[str, GroupFilter] = {"nonzero_std": nonzero_std}
"""Filters selectable by name."""


def check_filter_path(path: str) -> None:
    """Raise unless `path` is a built-in filter name or import-path syntax; imports nothing."""
    if path in BUILTIN_FILTERS:
        return
    if ":" not in path and "." not in path:
        raise ValueError(
            f"{FILTER_FLAG} {path!r} is neither a built-in filter "
            f"({', '.join(BUILTIN_FILTERS)}) nor an import path 'package.module:function'"
        )
    split_import_path(path, FILTER_FLAG)


def resolve_filter(path: str) -> GroupFilter:
    """The filter that `path` names: a built-in name or an import path."""
    if path in BUILTIN_FILTERS:
        return BUILTIN_FILTERS[path]
    check_filter_path(path)
    return load_function(path, FILTER_FLAG)


def keep_group(group_filter: GroupFilter, group: list[Sample]) -> bool:
    """Apply `group_filter`; a non-bool answer is an error (a truthy object is a likely bug)."""
    keep = group_filter(group)
    if not isinstance(keep, bool):
        raise TypeError(
            f"{FILTER_FLAG} function {getattr(group_filter, '__name__', group_filter)!r} returned "
            f"{keep!r} ({type(keep).__name__}); it must return True (keep) or False (drop)"
        )
    return keep
