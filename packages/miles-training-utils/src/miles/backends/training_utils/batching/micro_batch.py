"""Group one rank's samples into micro-batches: a fixed number of samples, or a token budget.

Dynamic batching guarantees the budget in every micro-batch, not on average (architecture.md: "Design rules"). Indices
are rows of the rank's batch; each micro-batch lists them in ascending order, and micro-batches are
ordered by their smallest index, so the result is a pure function of the lengths.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from miles.backends.training_utils.batching.balance import get_seqlen_balanced_partitions

_BUDGET_FLAG = "--max-tokens-per-gpu"


def fixed_micro_batches(num_samples: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive runs of `micro_batch_size` indices; the last one is shorter on a remainder."""
    if micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be at least 1, got {micro_batch_size}")
    if num_samples < 0:
        raise ValueError(f"num_samples must be non-negative, got {num_samples}")
    return [
        list(range(start, min(start + micro_batch_size, num_samples)))
        for start in range(0, num_samples, micro_batch_size)
    ]


def _check_budget(seqlens: Sequence[int], max_tokens_per_gpu: int) -> None:
    if max_tokens_per_gpu < 1:
        raise ValueError(f"{_BUDGET_FLAG} must be at least 1, got {max_tokens_per_gpu}")
    for i, length in enumerate(seqlens):
        if length > max_tokens_per_gpu:
            raise ValueError(
                f"sample {i} has {length} tokens (prompt + response), more than "
                f"{_BUDGET_FLAG} ({max_tokens_per_gpu}); raise {_BUDGET_FLAG} to at least "
                f"{length} or cap the prompt and response lengths below it"
            )


def _ordered(groups: list[list[int]]) -> list[list[int]]:
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def _fits(groups: list[list[int]], seqlens: Sequence[int], max_tokens: int) -> bool:
    return all(g and sum(seqlens[i] for i in g) <= max_tokens for g in groups)


def _first_fit_decreasing(seqlens: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Longest sample first, each into the first micro-batch it fits in (at most 11/9 OPT + 1)."""
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(seqlens)), key=lambda i: (-seqlens[i], i)):
        for g, load in enumerate(loads):
            if load + seqlens[i] <= max_tokens:
                groups[g].append(i)
                loads[g] += seqlens[i]
                break
        else:
            groups.append([i])
            loads.append(seqlens[i])
    return groups


def _split_until(groups: list[list[int]], seqlens: Sequence[int], count: int) -> list[list[int]]:
    """Halve the heaviest splittable micro-batch until there are `count`; halves stay in budget."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [g for g in groups if len(g) >= 2]
        assert splittable, (
            f"cannot reach {count} micro-batches from {sum(map(len, groups))} samples"
        )
        heaviest = max(splittable, key=lambda g: (sum(seqlens[i] for i in g), -min(g)))
        groups.remove(heaviest)
        halves = get_seqlen_balanced_partitions([seqlens[i] for i in heaviest], 2, False)
        groups.extend([heaviest[j] for j in half] for half in halves)
    return groups


def _pack(seqlens: Sequence[int], max_tokens: int, count: int | None) -> list[list[int]]:
    _check_budget(seqlens, max_tokens)
    ffd = _first_fit_decreasing(seqlens, max_tokens)
    if count is None:
        # Balanced micro-batches when they fit (similar step times, and FFD's count is not always
        # the minimum); the token total gives a lower bound on how many are needed.
        lower = max(1, math.ceil(sum(seqlens) / max_tokens))
        for m in range(lower, len(ffd) + 1):
            balanced = get_seqlen_balanced_partitions(seqlens, m, False)
            if _fits(balanced, seqlens, max_tokens):
                return _ordered(balanced)
        return _ordered(ffd)
    if not 1 <= count <= len(seqlens):
        raise ValueError(
            f"cannot make {count} non-empty micro-batches from {len(seqlens)} samples; ask for "
            f"between 1 and {len(seqlens)}"
        )
    balanced = get_seqlen_balanced_partitions(seqlens, count, False)
    if _fits(balanced, seqlens, max_tokens):
        return _ordered(balanced)
    if len(ffd) <= count:
        return _ordered(_split_until(ffd, seqlens, count))
    raise ValueError(
        f"cannot pack {len(seqlens)} samples ({sum(seqlens)} tokens) into {count} micro-batches "
        f"of at most {max_tokens} tokens ({_BUDGET_FLAG}); {len(ffd)} are needed: ask for at "
        f"least {len(ffd)} micro-batches or raise {_BUDGET_FLAG}"
    )


def dynamic_micro_batches(
    seqlens: Sequence[int], max_tokens_per_gpu: int, *, num_batches: int | None = None
) -> list[list[int]]:
    """Pack sample indices into micro-batches of at most `max_tokens_per_gpu` tokens each.

    `seqlens[i]` is the total length (prompt + response) of sample i. Without `num_batches`, makes
    as few micro-batches as it can find (balanced ones where possible). With `num_batches`, makes
    exactly that many, e.g. the maximum of `num_micro_batches` over data-parallel ranks so every
    rank runs the same number of steps; it raises when they cannot fit the budget.
    """
    if not seqlens and num_batches is None:
        return []
    return _pack(seqlens, max_tokens_per_gpu, num_batches)


def num_micro_batches(seqlens: Sequence[int], max_tokens_per_gpu: int) -> int:
    """How many micro-batches `dynamic_micro_batches` makes for these lengths without a count."""
    return len(dynamic_micro_batches(seqlens, max_tokens_per_gpu))
