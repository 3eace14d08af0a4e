"""Micro-batching: the token budget holds in every micro-batch, indices are covered exactly once."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.training_utils.batching.micro_batch import (
    dynamic_micro_batches,
    fixed_micro_batches,
    num_micro_batches,
)

BUDGET = st.integers(16, 4096)


@st.composite
def seqlens_within(draw):
    budget = draw(BUDGET)
    seqlens = draw(st.lists(st.integers(1, budget), min_size=1, max_size=80))
    return seqlens, budget


def _first_fit_count(seqlens, budget):
    """Independent first-fit-decreasing bin count, the bound the packer must not exceed."""
    loads = []
    for length in sorted(seqlens, reverse=True):
        for b, load in enumerate(loads):
            if load + length <= budget:
                loads[b] += length
                break
        else:
            loads.append(length)
    return len(loads)


def _assert_valid(micro, seqlens, budget):
    assert sorted(i for mb in micro for i in mb) == list(range(len(seqlens)))
    for mb in micro:
        assert mb, "no micro-batch may be empty"
        assert mb == sorted(mb), "indices inside a micro-batch are in ascending order"
        assert sum(seqlens[i] for i in mb) <= budget


@settings(max_examples=100, deadline=None)
@given(case=seqlens_within())
def test_every_dynamic_micro_batch_respects_the_budget_and_covers_each_index_once(case):
    seqlens, budget = case
    _assert_valid(dynamic_micro_batches(seqlens, budget), seqlens, budget)


@settings(max_examples=100, deadline=None)
@given(case=seqlens_within())
def test_dynamic_count_lies_between_the_token_lower_bound_and_first_fit_decreasing(case):
    seqlens, budget = case
    count = num_micro_batches(seqlens, budget)
    assert math.ceil(sum(seqlens) / budget) <= count <= _first_fit_count(seqlens, budget)
    assert count == len(dynamic_micro_batches(seqlens, budget))


@settings(max_examples=80, deadline=None)
@given(case=seqlens_within(), data=st.data())
def test_a_requested_count_at_or_above_the_minimum_is_met_exactly_within_budget(case, data):
    seqlens, budget = case
    minimum = num_micro_batches(seqlens, budget)
    count = data.draw(st.integers(minimum, len(seqlens)))
    micro = dynamic_micro_batches(seqlens, budget, num_batches=count)
    assert len(micro) == count
    _assert_valid(micro, seqlens, budget)


@settings(max_examples=50, deadline=None)
@given(case=seqlens_within())
def test_dynamic_micro_batches_are_deterministic_and_ordered_by_first_index(case):
    seqlens, budget = case
    micro = dynamic_micro_batches(seqlens, budget)
    assert micro == dynamic_micro_batches(list(seqlens), budget)
    firsts = [mb[0] for mb in micro]
    assert firsts == sorted(firsts)


def test_samples_that_exactly_fill_the_budget_each_get_their_own_micro_batch():
    assert dynamic_micro_batches([10, 10, 10], 10) == [[0], [1], [2]]


def test_a_sample_longer_than_the_budget_names_its_index_length_and_the_flag():
    with pytest.raises(
        ValueError,
        match=r"sample 2 has 300 tokens .* more than --max-tokens-per-gpu \(256\); "
        r"raise --max-tokens-per-gpu to at least 300",
    ):
        dynamic_micro_batches([10, 20, 300], 256)


def test_a_count_too_small_for_the_budget_is_rejected_with_the_needed_count():
    with pytest.raises(
        ValueError, match=r"into 1 micro-batches of at most 10 tokens .* 3 are needed"
    ):
        dynamic_micro_batches([8, 8, 8], 10, num_batches=1)


def test_a_count_above_the_number_of_samples_is_rejected():
    with pytest.raises(ValueError, match=r"cannot make 4 non-empty micro-batches from 3 samples"):
        dynamic_micro_batches([1, 1, 1], 10, num_batches=4)


def test_a_budget_below_one_is_rejected():
    with pytest.raises(ValueError, match=r"--max-tokens-per-gpu must be at least 1, got 0"):
        dynamic_micro_batches([1], 0)


def test_no_samples_make_no_micro_batches():
    assert dynamic_micro_batches([], 10) == []
    assert num_micro_batches([], 10) == 0


def test_fixed_micro_batches_are_consecutive_runs_with_a_short_last_one():
    assert fixed_micro_batches(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert fixed_micro_batches(6, 3) == [[0, 1, 2], [3, 4, 5]]
    assert fixed_micro_batches(0, 3) == []


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 200), size=st.integers(1, 50))
def test_fixed_micro_batches_cover_each_index_once_and_hold_at_most_the_size(n, size):
    micro = fixed_micro_batches(n, size)
    assert [i for mb in micro for i in mb] == list(range(n))
    assert all(1 <= len(mb) <= size for mb in micro)
    assert len(micro) == math.ceil(n / size)


def test_fixed_micro_batch_size_below_one_is_rejected():
    with pytest.raises(ValueError, match=r"--micro-batch-size must be at least 1, got 0"):
        fixed_micro_batches(4, 0)
