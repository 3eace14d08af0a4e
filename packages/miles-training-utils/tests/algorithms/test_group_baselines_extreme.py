"""Group baselines on any finite reward, 1e308 and 1e200 included, against exact references.

The references compute in `fractions.Fraction` (exact rationals) and round once at the end, so
they cannot overflow or cancel; the only tolerance allowed is the rounding of a float64 group mean
(n ulps of the group's largest reward), amplified by the division by std + eps.
"""

from __future__ import annotations

import math
import sys
from fractions import Fraction

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from miles.backends.training_utils.algorithms.formulas.group_baselines import (
    group_normalize_rewards,
    rloo_advantages,
)

PROPERTY = settings(max_examples=200, deadline=None)
FLOAT_MAX = sys.float_info.max

# Every finite float, with the magnitudes of the rewards drawn often.
any_reward = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e308, -1e308, 1e200, -1e200, FLOAT_MAX, 0.0, 1.0, 1e-300]),
)


@st.composite
def extreme_groups(draw):
    group_size = draw(st.integers(2, 6))
    n_groups = draw(st.integers(1, 3))
    rewards = draw(st.lists(any_reward, min_size=group_size * n_groups,
                            max_size=group_size * n_groups))  # fmt: skip
    return rewards, group_size


def _groups(rewards, group_size):
    for start in range(0, len(rewards), group_size):
        yield [Fraction(r) for r in rewards[start : start + group_size]]


def _largest(group) -> float:
    return float(max(abs(r) for r in group))


def exact_centred(rewards, group_size, leave_one_out=False):
    """(value, tolerance) per sample: r - mean (or r - mean of the others), exactly."""
    out = []
    for group in _groups(rewards, group_size):
        n, total = len(group), sum(group)
        tol = 4 * n * math.ulp(_largest(group))
        for r in group:
            if max(group) == min(group):
                out.append((Fraction(0), 0.0))
            else:
                out.append((r - (total - r) / (n - 1) if leave_one_out else r - total / n, tol))
    return out


def exact_normalized(rewards, group_size, eps=1e-6):
    """(value, tolerance) per sample: (r - mean) / (std + eps), unbiased std, exactly up to
    the square root (taken of the variance scaled into float's range)."""
    out = []
    for group in _groups(rewards, group_size):
        n = len(group)
        if max(group) == min(group):
            out += [(0.0, 0.0)] * n
            continue
        mean = sum(group) / n
        scale = Fraction(max(abs(r) for r in group))
        var_scaled = sum(((r - mean) / scale) ** 2 for r in group) / (n - 1)
        denominator = math.sqrt(float(var_scaled)) + eps / float(scale)  # (std + eps) / scale
        # The mean's rounding, n ulps of the largest reward, divided by (std + eps).
        tol = 4 * n * 2.0**-52 / denominator + 1e-9
        out += [(float((r - mean) / scale) / denominator, tol) for r in group]
    return out


def _check(got: torch.Tensor, expected) -> None:
    assert bool(torch.isfinite(got).all()), f"non-finite output {got.tolist()}"
    for i, (value, (ref, tol)) in enumerate(zip(got.tolist(), expected, strict=True)):
        assert abs(value - float(ref)) <= tol * (1 + 1e-9), f"[{i}] got {value}, exact {ref}"


def _representable(expected) -> bool:
    return all(abs(ref) < FLOAT_MAX for ref, _ in expected)


def _near_float_max(expected) -> bool:
    """An exact value within rounding of the largest float: either outcome is right."""
    edge = Fraction(FLOAT_MAX)
    return any(abs(abs(ref) / edge - 1) < Fraction(1, 10**9) for ref, _ in expected)


@PROPERTY
@given(extreme_groups())
@example(([1e308, 0.0] * 4, 4))  # half the samples at 1e308: the sum overflowed
@example(([1e200, 0.0, 0.0, 0.0], 4))  # its square overflowed: the advantage came out 0
def test_grpo_advantages_of_any_finite_rewards_match_the_exact_ones(data):
    rewards, group_size = data
    got = group_normalize_rewards(torch.tensor(rewards, dtype=torch.float64), group_size)
    _check(got, exact_normalized(rewards, group_size))


@PROPERTY
@given(extreme_groups(), st.booleans())
@example(([1e308, 0.0] * 4, 4), False)
@example(([1e200, 0.0, 0.0, 0.0], 4), True)
def test_centred_and_leave_one_out_advantages_match_the_exact_ones_or_refuse(data, rloo):
    rewards, group_size = data
    expected = exact_centred(rewards, group_size, leave_one_out=rloo)
    tensor = torch.tensor(rewards, dtype=torch.float64)
    assume(not _near_float_max(expected))
    if not _representable(expected):
        # Rewards of opposite signs near float's maximum: r - mean itself is beyond it.
        with pytest.raises(ValueError, match="--reward-clip"):
            rloo_advantages(tensor, group_size) if rloo else group_normalize_rewards(
                tensor, group_size, std_normalization=False
            )
        return
    got = (
        rloo_advantages(tensor, group_size)
        if rloo
        else group_normalize_rewards(tensor, group_size, std_normalization=False)
    )
    _check(got, expected)


@pytest.mark.parametrize("large", [1e308, 1e200])
def test_rewards_of_1e308_or_1e200_for_half_the_samples_give_the_advantages_of_1_and_0(large):
    got = group_normalize_rewards(torch.tensor([large, 0.0] * 4, dtype=torch.float64), 4)
    ones = group_normalize_rewards(torch.tensor([1.0, 0.0] * 4, dtype=torch.float64), 4)
    # Equal but for eps, which is 1e-6 of a reward of 1 and nothing of 1e200.
    torch.testing.assert_close(got, ones, rtol=1e-5, atol=0)
    assert bool((got.abs() > 0.8).all()), "a nonzero advantage for every sample, not 0"
