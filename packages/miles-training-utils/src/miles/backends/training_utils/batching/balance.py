"""Split weighted items (samples weighed by token count) into k groups of near-equal total weight.

Used to spread samples over data-parallel ranks and over micro-batches. The largest differencing
method (Karmarkar-Karp) usually beats greedy, but not always, so `get_seqlen_balanced_partitions`
returns whichever of the two has the lighter heaviest group. Partitions are lists of item indices.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

# One group of a partial solution: (total weight, item indices).
_Group = tuple[int, list[int]]


def _check_args(weights: Sequence[int], k: int, equal_size: bool) -> None:
    if k < 1:
        raise ValueError(f"the number of partitions k must be at least 1, got {k}")
    negative = [(i, w) for i, w in enumerate(weights) if w < 0]
    if negative:
        raise ValueError(f"weights must be non-negative, got (index, weight) pairs {negative[:8]}")
    if equal_size and len(weights) % k:
        raise ValueError(
            f"equal_size partitions need the number of items ({len(weights)}) to be divisible by "
            f"k ({k}); use a multiple of {k} items or pass equal_size=False"
        )


def _finish(groups: list[list[int]]) -> list[list[int]]:
    """Sorted indices inside each group, groups ordered by their smallest index (empty last)."""
    ordered = [sorted(g) for g in groups]
    return sorted(ordered, key=lambda g: (not g, g[0] if g else 0))


def _sort_groups(groups: list[_Group]) -> list[_Group]:
    # Heaviest first; ties broken by the indices so the result never depends on dict/heap luck.
    return sorted(groups, key=lambda g: (-g[0], g[1]))


def _merge(a: list[_Group], b: list[_Group]) -> list[_Group]:
    """Pair a's heaviest group with b's lightest and so on: the 'differencing' step of LDM."""
    k = len(a)
    return _sort_groups([(a[i][0] + b[k - 1 - i][0], a[i][1] + b[k - 1 - i][1]) for i in range(k)])


def karmarkar_karp(weights: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """Largest differencing method generalised to k partitions (Karmarkar & Karp, 1982).

    Every item starts as a partial solution of k groups; the two partial solutions with the largest
    spread (heaviest minus lightest group) are repeatedly merged, heaviest group with lightest, so
    large differences cancel early. With `equal_size`, items are seeded k at a time (one per group,
    in weight order) so every group ends with exactly len(weights) / k items.
    """
    _check_args(weights, k, equal_size)
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    if equal_size:
        seeds = [order[start : start + k] for start in range(0, len(order), k)]
        states = [[(weights[i], [i]) for i in chunk] for chunk in seeds]
    else:
        states = [[(weights[i], [i])] + [(0, [])] * (k - 1) for i in order]
    if not states:
        return [[] for _ in range(k)]

    tie = itertools.count()  # insertion order breaks remaining ties: deterministic output

    def entry(state: list[_Group]) -> tuple[int, int, int, list[_Group]]:
        state = _sort_groups(state)
        return (-(state[0][0] - state[-1][0]), -state[0][0], next(tie), state)

    heap = [entry(s) for s in states]
    heapq.heapify(heap)
    while len(heap) > 1:
        first = heapq.heappop(heap)[-1]
        second = heapq.heappop(heap)[-1]
        heapq.heappush(heap, entry(_merge(first, second)))
    return _finish([indices for _, indices in heap[0][-1]])


def greedy_partition(weights: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """Heaviest item first, each into the currently lightest group that still has room.

    With `equal_size` a group has room until it holds len(weights) / k items.
    """
    _check_args(weights, k, equal_size)
    capacity = len(weights) // k if equal_size else len(weights)
    groups: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, g) for g in range(k)]  # (group weight, group id): lightest, then lowest id
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        total, g = heapq.heappop(heap)
        groups[g].append(i)
        if len(groups[g]) < capacity:
            heapq.heappush(heap, (total + weights[i], g))
    return _finish(groups)


def partition_sums(weights: Sequence[int], partitions: list[list[int]]) -> list[int]:
    """Total weight of each partition."""
    return [sum(weights[i] for i in part) for part in partitions]


def get_seqlen_balanced_partitions(
    seqlens: Sequence[int], k: int, equal_size: bool
) -> list[list[int]]:
    """Partition sample indices into k groups of near-equal total length.

    Runs Karmarkar-Karp and greedy and keeps the one whose heaviest group is lighter (Karmarkar-Karp
    on ties), so the result is never worse than greedy.
    """
    kk = karmarkar_karp(seqlens, k, equal_size)
    greedy = greedy_partition(seqlens, k, equal_size)
    if max(partition_sums(seqlens, kk)) <= max(partition_sums(seqlens, greedy)):
        return kk
    return greedy
