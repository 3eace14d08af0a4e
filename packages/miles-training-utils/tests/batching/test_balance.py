"""Balanced partitioning: coverage, equal sizes, never worse than greedy, clear errors."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.training_utils.batching.balance import (
    get_seqlen_balanced_partitions,
    greedy_partition,
    karmarkar_karp,
    partition_sums,
)

PARTITIONERS = [karmarkar_karp, greedy_partition, get_seqlen_balanced_partitions]


@st.composite
def weights_and_k(draw, equal_size: bool):
    k = draw(st.integers(1, 8))
    if equal_size:
        n = k * draw(st.integers(0, 12))
        return draw(st.lists(st.integers(0, 5000), min_size=n, max_size=n)), k
    return draw(st.lists(st.integers(0, 5000), max_size=60)), k


def _assert_exact_cover(partitions, n, k):
    assert len(partitions) == k
    flat = [i for part in partitions for i in part]
    assert sorted(flat) == list(range(n))


@pytest.mark.parametrize("partition", PARTITIONERS)
@settings(max_examples=60, deadline=None)
@given(data=st.data(), equal_size=st.booleans())
def test_every_index_lands_in_exactly_one_of_k_partitions(partition, data, equal_size):
    weights, k = data.draw(weights_and_k(equal_size))
    _assert_exact_cover(partition(weights, k, equal_size), len(weights), k)


@pytest.mark.parametrize("partition", PARTITIONERS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_equal_size_partitions_have_equal_counts(partition, data):
    weights, k = data.draw(weights_and_k(equal_size=True))
    counts = {len(part) for part in partition(weights, k, True)}
    assert counts == {len(weights) // k}


@settings(max_examples=100, deadline=None)
@given(data=st.data(), equal_size=st.booleans())
def test_balanced_max_partition_sum_is_never_worse_than_greedy(data, equal_size):
    weights, k = data.draw(weights_and_k(equal_size))
    balanced = get_seqlen_balanced_partitions(weights, k, equal_size)
    greedy = greedy_partition(weights, k, equal_size)
    assert max(partition_sums(weights, balanced)) <= max(partition_sums(weights, greedy))


@settings(max_examples=50, deadline=None)
@given(data=st.data(), equal_size=st.booleans())
def test_partitions_are_deterministic_and_sorted_inside(data, equal_size):
    weights, k = data.draw(weights_and_k(equal_size))
    first = karmarkar_karp(weights, k, equal_size)
    assert first == karmarkar_karp(list(weights), k, equal_size)
    assert all(part == sorted(part) for part in first)


def test_karmarkar_karp_beats_greedy_on_the_textbook_instance():
    # Greedy: {8, 5, 4} vs {7, 6} -> 17; differencing: 16 (optimum 15).
    weights = [8, 7, 6, 5, 4]
    assert max(partition_sums(weights, greedy_partition(weights, 2, False))) == 17
    assert max(partition_sums(weights, karmarkar_karp(weights, 2, False))) == 16
    assert max(partition_sums(weights, get_seqlen_balanced_partitions(weights, 2, False))) == 16


def test_equal_size_keeps_counts_even_when_one_item_dominates():
    weights = [1000, 1, 1, 1]
    partitions = get_seqlen_balanced_partitions(weights, 2, True)
    assert sorted(len(p) for p in partitions) == [2, 2]


def test_more_partitions_than_items_leaves_some_empty_without_equal_size():
    partitions = karmarkar_karp([3, 1], 4, False)
    _assert_exact_cover(partitions, 2, 4)
    assert sum(1 for p in partitions if not p) == 2


def test_equal_size_requires_item_count_divisible_by_k():
    with pytest.raises(ValueError, match=r"number of items \(10\) to be divisible by k \(4\)"):
        karmarkar_karp(list(range(10)), 4, True)


def test_k_below_one_is_rejected():
    with pytest.raises(ValueError, match=r"k must be at least 1, got 0"):
        greedy_partition([1, 2], 0, False)


def test_negative_weights_are_rejected_naming_them():
    with pytest.raises(
        ValueError, match=r"non-negative, got \(index, weight\) pairs \[\(1, -5\)\]"
    ):
        get_seqlen_balanced_partitions([1, -5, 2], 2, False)
