"""RL formulas against independent float64 references written as plain Python loops.

The references below never call the module under test; hypothesis draws the inputs, including
empty masks, single-sample groups, all-equal rewards, log-ratios of +-50 and log-probs of -1e4.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.training_utils.algorithms.formulas.group_baselines import (
    group_normalize_rewards,
    rloo_advantages,
)
from miles.backends.training_utils.algorithms.formulas.kl import compute_approx_kl
from miles.backends.training_utils.algorithms.formulas.off_policy import (
    compute_icepop_weights,
    compute_mis_weights,
    compute_tis_weights,
)
from miles.backends.training_utils.algorithms.formulas.policy_losses import (
    compute_gspo_kl,
    compute_policy_loss,
    compute_sft_loss,
    compute_value_loss,
)
from miles.backends.training_utils.algorithms.formulas.returns import (
    get_gae_advantages_and_returns,
    get_reinforce_plus_plus_returns,
    whiten,
)
from miles.backends.training_utils.algorithms.loss_config import KL_TYPES
from miles.backends.training_utils.algorithms.registry import ESTIMATORS

PROPERTY = settings(max_examples=50, deadline=None)

# ---------------------------------------------------------------- helpers and strategies


def _t(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _assert_matches(actual: torch.Tensor, expected, rtol: float = 1e-9, atol: float = 1e-12):
    """Finite, float64, same shape, and close to the reference element by element."""
    assert actual.dtype == torch.float64
    assert bool(torch.isfinite(actual).all()), f"non-finite output {actual.tolist()}"
    got = actual.tolist()
    assert len(got) == len(expected), (got, expected)
    for i, (a, e) in enumerate(zip(got, expected, strict=True)):
        assert math.isclose(a, e, rel_tol=rtol, abs_tol=atol), f"[{i}] got {a}, expected {e}"


def _floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, allow_subnormal=False)


# Quarter-integers: exact in float64, many ties, so all-equal groups come up often.
grid_rewards = st.integers(-8, 8).map(lambda k: k / 4)
log_probs = _floats(-1e4, 0.0)


@st.composite
def grouped_rewards(draw, values=grid_rewards):
    group_size = draw(st.integers(1, 6))
    n_groups = draw(st.integers(0, 5))
    return draw(
        st.lists(values, min_size=group_size * n_groups, max_size=group_size * n_groups)
    ), group_size


@st.composite
def log_prob_pair(draw):
    """(a, b): either independent log-probs in [-1e4, 0], or a - b in [-50, 50]."""
    if draw(st.booleans()):
        return draw(log_probs), draw(log_probs)
    a = draw(_floats(-30.0, 0.0))
    return a, a - draw(_floats(-50.0, 50.0))


@st.composite
def packed_samples(draw, min_samples: int = 0):
    """Concatenated (a, b) log-prob pairs over samples, with per-sample masks and lengths."""
    lengths = draw(st.lists(st.integers(0, 6), min_size=min_samples, max_size=4))
    pairs = draw(st.lists(log_prob_pair(), min_size=sum(lengths), max_size=sum(lengths)))
    masks = [draw(st.lists(st.booleans(), min_size=n, max_size=n)) for n in lengths]
    return [p[0] for p in pairs], [p[1] for p in pairs], masks, lengths


@st.composite
def token_sequences(draw, n_series: int):
    """Per-sample lists of n_series value series in [-10, 10] and one boolean mask each."""
    lengths = draw(st.lists(st.integers(0, 8), min_size=0, max_size=4))
    series = [
        [draw(st.lists(_floats(-10.0, 10.0), min_size=n, max_size=n)) for n in lengths]
        for _ in range(n_series)
    ]
    masks = [draw(st.lists(st.booleans(), min_size=n, max_size=n)) for n in lengths]
    return series, masks


def _split(flat, lengths):
    out, start = [], 0
    for n in lengths:
        out.append(flat[start : start + n])
        start += n
    return out


# ---------------------------------------------------------------- references


def ref_group_normalize(rewards, group_size, std_normalization, eps=1e-6):
    out = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g : g + group_size]
        if max(group) == min(group):
            out += [0.0] * group_size
            continue
        mean = math.fsum(group) / group_size
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in group) / (group_size - 1))
        out += [(r - mean) / (std + eps) if std_normalization else r - mean for r in group]
    return out


def ref_rloo(rewards, group_size):
    out = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g : g + group_size]
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1 :]
            out.append(
                r - math.fsum(others) / len(others) if others and max(group) != min(group) else 0.0
            )
    return out


def ref_kl(lp, ref, kl_type):
    x = lp - ref
    if kl_type == "k1":
        return x
    if kl_type == "k2":
        return 0.5 * x * x
    neg = min(-x, 20.0)
    kl = math.exp(neg) - 1 - neg
    return min(max(kl, -10.0), 10.0) if kl_type == "low_var_kl" else kl


def ref_policy_loss(k, a, eps_clip, eps_clip_high, eps_clip_c):
    """(loss, clipped, d loss / d ppo_kl) for one token."""
    ratio = math.exp(-k)
    clamped = min(max(ratio, 1 - eps_clip), 1 + eps_clip_high)
    loss1, loss2 = -a * ratio, -a * clamped
    clipped = loss2 > loss1
    loss, grad = (loss2, 0.0) if clipped else (loss1, a * ratio)
    if eps_clip_c is not None and a < 0 and -a * eps_clip_c < loss:
        loss, grad = -a * eps_clip_c, 0.0
    return loss, float(clipped), grad


def ref_masked_mean(xs, mask):
    kept = [x for x, m in zip(xs, mask, strict=True) if m]
    return math.fsum(kept) / len(kept) if kept else 0.0


def ref_mis(train, rollout, masks, lengths, clip_high, veto):
    weights, keep = [], []
    for tr, ro, m in zip(_split(train, lengths), _split(rollout, lengths), masks, strict=True):
        d = [a - b for a, b in zip(tr, ro, strict=True)]
        rho = _exp(ref_masked_mean(d, m))
        vetoed = any(_exp(x) < veto for x, mm in zip(d, m, strict=True) if mm) or rho > clip_high
        keep.append(0.0 if vetoed else 1.0)
        weights += [0.0 if vetoed else rho] * len(d)
    return weights, keep


def ref_returns(rewards, mask, gamma):
    out, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        if mask[t]:
            running = rewards[t] + gamma * running
            out[t] = running
    return out


def ref_gae(rewards, values, mask, gamma, lam):
    adv, ret = [0.0] * len(rewards), [0.0] * len(rewards)
    gae, next_value = 0.0, 0.0
    for t in reversed(range(len(rewards))):
        if mask[t]:
            delta = rewards[t] + gamma * next_value - values[t]
            gae = delta + gamma * lam * gae
            adv[t], ret[t], next_value = gae, gae + values[t], values[t]
    return adv, ret


def ref_whiten(xs, mask, eps, shift_mean):
    kept = [x for x, m in zip(xs, mask, strict=True) if m]
    n = len(kept)
    mean = math.fsum(kept) / n if n else 0.0
    scale = 1.0 / math.sqrt(math.fsum((x - mean) ** 2 for x in kept) / n + eps) if n >= 2 else 1.0
    shift = 0.0 if shift_mean else mean
    return [(x - mean) * scale + shift if m else 0.0 for x, m in zip(xs, mask, strict=True)]


# ---------------------------------------------------------------- group baselines


@PROPERTY
@given(grouped_rewards(), st.booleans())
def test_group_normalize_matches_reference_on_tied_rewards(data, std_normalization):
    rewards, group_size = data
    got = group_normalize_rewards(_t(rewards), group_size, std_normalization=std_normalization)
    _assert_matches(got, ref_group_normalize(rewards, group_size, std_normalization))


@PROPERTY
@given(grouped_rewards(values=_floats(-100.0, 100.0)), st.booleans())
def test_group_normalize_matches_reference_on_arbitrary_floats(data, std_normalization):
    rewards, group_size = data
    got = group_normalize_rewards(_t(rewards), group_size, std_normalization=std_normalization)
    # Rounding in r - mean (~1e-14 at |r| = 100) is divided by std + eps >= 1e-6.
    _assert_matches(got, ref_group_normalize(rewards, group_size, std_normalization), atol=1e-7)


@pytest.mark.parametrize("std_normalization", [True, False])
def test_zero_spread_group_gets_zero_advantage_not_nan(std_normalization):
    # A naive r - mean leaves ~1e-17 here (0.1 * 3 / 3 != 0.1), ~1e-11 after dividing by eps.
    got = group_normalize_rewards(_t([0.1, 0.1, 0.1, 1.0, 2.0, 3.0]), 3, std_normalization)
    assert got[:3].tolist() == [0.0, 0.0, 0.0]
    assert got[3:].tolist() == pytest.approx(
        [-1.0, 0.0, 1.0] if std_normalization else [-1, 0, 1], rel=1e-5
    )


def test_single_sample_groups_get_zero_advantage():
    rewards = _t([3.0, -1.0, 7.5])
    assert group_normalize_rewards(rewards, 1).tolist() == [0.0, 0.0, 0.0]
    assert group_normalize_rewards(rewards, 1, std_normalization=False).tolist() == [0.0] * 3
    assert rloo_advantages(rewards, 1).tolist() == [0.0, 0.0, 0.0]


@PROPERTY
@given(grouped_rewards(values=st.one_of(grid_rewards, _floats(-100.0, 100.0))))
def test_rloo_subtracts_the_mean_of_the_other_samples(data):
    rewards, group_size = data
    _assert_matches(
        rloo_advantages(_t(rewards), group_size), ref_rloo(rewards, group_size), atol=1e-10
    )


@pytest.mark.parametrize("fn", [group_normalize_rewards, rloo_advantages])
def test_partial_group_is_rejected_with_sizes(fn):
    with pytest.raises(ValueError, match=r"shape \(5,\).*multiple of group_size \(2\)"):
        fn(_t([1.0] * 5), 2)
    with pytest.raises(ValueError, match=r"group_size \(0\) must be >= 1"):
        fn(_t([1.0] * 4), 0)


# ---------------------------------------------------------------- KL estimators


@PROPERTY
@given(st.lists(log_prob_pair(), max_size=8), st.sampled_from(KL_TYPES))
def test_approx_kl_matches_reference_for_every_estimator(pairs, kl_type):
    lp, ref = [p[0] for p in pairs], [p[1] for p in pairs]
    got = compute_approx_kl(_t(lp), _t(ref), kl_type)
    _assert_matches(got, [ref_kl(a, b, kl_type) for a, b in pairs])
    if kl_type in ("k2", "k3", "low_var_kl"):
        assert bool((got >= 0).all())


def test_k3_stays_finite_when_reference_is_far_more_likely():
    got = compute_approx_kl(_t([-1e4, -60.0]), _t([0.0, 0.0]), "k3")
    assert got.tolist() == pytest.approx([math.exp(20) - 21] * 2, rel=1e-12)
    assert compute_approx_kl(_t([-1e4]), _t([0.0]), "low_var_kl").tolist() == [10.0]


def test_unknown_kl_type_is_rejected_naming_the_choices():
    with pytest.raises(ValueError, match=r"unknown kl_type 'k4'.*'k1', 'k2', 'k3', 'low_var_kl'"):
        compute_approx_kl(_t([0.0]), _t([0.0]), "k4")


def test_mismatched_shapes_are_rejected_with_both_shapes():
    with pytest.raises(
        ValueError, match=r"log_probs \(shape \(2,\)\) and ref_log_probs \(shape \(3,\)\)"
    ):
        compute_approx_kl(_t([0.0, 0.0]), _t([0.0, 0.0, 0.0]), "k1")


# ---------------------------------------------------------------- policy, value and SFT losses


@st.composite
def policy_inputs(draw):
    n = draw(st.integers(0, 8))
    ppo_kl = draw(st.lists(_floats(-50.0, 50.0), min_size=n, max_size=n))
    advantages = draw(st.lists(_floats(-10.0, 10.0), min_size=n, max_size=n))
    eps_clip_c = draw(st.one_of(st.none(), _floats(1.01, 10.0)))
    return ppo_kl, advantages, draw(_floats(0.0, 0.9)), draw(_floats(0.0, 2.0)), eps_clip_c


@PROPERTY
@given(policy_inputs())
def test_policy_loss_matches_clipped_surrogate_reference(inputs):
    ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c = inputs
    loss, clipfrac = compute_policy_loss(
        _t(ppo_kl), _t(advantages), eps_clip, eps_clip_high, eps_clip_c
    )
    ref = [
        ref_policy_loss(k, a, eps_clip, eps_clip_high, eps_clip_c)
        for k, a in zip(ppo_kl, advantages, strict=True)
    ]
    _assert_matches(loss, [r[0] for r in ref])
    _assert_matches(clipfrac, [r[1] for r in ref])


@PROPERTY
@given(policy_inputs())
def test_policy_loss_gradient_is_zero_on_clipped_side_and_whole_elsewhere(inputs):
    ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c = inputs
    kl = _t(ppo_kl).requires_grad_()
    loss, _ = compute_policy_loss(kl, _t(advantages), eps_clip, eps_clip_high, eps_clip_c)
    loss.sum().backward()
    ref = [
        ref_policy_loss(k, a, eps_clip, eps_clip_high, eps_clip_c)
        for k, a in zip(ppo_kl, advantages, strict=True)
    ]
    _assert_matches(kl.grad, [r[2] for r in ref])


def test_on_policy_token_keeps_its_whole_gradient_when_the_clip_range_is_zero():
    # ratio 1 sits on both bounds: a max() would split the gradient 50/50 between the branches.
    kl = _t([0.0, 0.0]).requires_grad_()
    loss, clipfrac = compute_policy_loss(kl, _t([2.0, -3.0]), eps_clip=0.0, eps_clip_high=0.0)
    loss.sum().backward()
    assert kl.grad.tolist() == [2.0, -3.0]
    assert clipfrac.tolist() == [0.0, 0.0]


def test_dual_clip_caps_the_loss_of_negative_advantages():
    # ratio e^3 ~ 20 with A = -1: unclipped loss ~20, capped at eps_clip_c = 3.
    loss, clipfrac = compute_policy_loss(
        _t([-3.0, -3.0]), _t([-1.0, 1.0]), 0.2, 0.2, eps_clip_c=3.0
    )
    assert loss.tolist() == pytest.approx([3.0, -1.2])
    assert clipfrac.tolist() == [0.0, 1.0]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (
            {"eps_clip": 0.2, "eps_clip_high": 0.2, "eps_clip_c": 1.0},
            r"eps_clip_c \(--eps-clip-c\) is 1\.0.*> 1\.0",
        ),
        ({"eps_clip": 1.5, "eps_clip_high": 0.2}, r"eps_clip \(--eps-clip\) is 1\.5.*\[0, 1\]"),
        (
            {"eps_clip": 0.2, "eps_clip_high": -0.1},
            r"eps_clip_high \(--eps-clip-high\) is -0\.1.*>= 0",
        ),
    ],
)
def test_policy_loss_rejects_bad_clip_settings(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        compute_policy_loss(_t([0.0]), _t([1.0]), **kwargs)


@PROPERTY
@given(st.data(), st.integers(0, 8), _floats(0.0, 10.0))
def test_value_loss_matches_clipped_reference(data, n, value_clip):
    draw = [data.draw(st.lists(_floats(-100.0, 100.0), min_size=n, max_size=n)) for _ in range(3)]
    values, old, returns = draw
    loss, clipfrac = compute_value_loss(_t(values), _t(old), _t(returns), value_clip)
    exp_loss, exp_clip = [], []
    for v, o, r in zip(values, old, returns, strict=True):
        v_clipped = o + min(max(v - o, -value_clip), value_clip)
        l1, l2 = (v - r) ** 2, (v_clipped - r) ** 2
        exp_loss.append(0.5 * max(l1, l2))
        exp_clip.append(float(l2 > l1))
    _assert_matches(loss, exp_loss)
    _assert_matches(clipfrac, exp_clip)


def test_value_loss_rejects_negative_clip():
    with pytest.raises(ValueError, match=r"value_clip \(--value-clip\) is -1\.0"):
        compute_value_loss(_t([0.0]), _t([0.0]), _t([0.0]), -1.0)


@PROPERTY
@given(st.lists(log_probs, max_size=8))
def test_sft_loss_is_negative_log_likelihood(lp):
    _assert_matches(compute_sft_loss(_t(lp)), [-x for x in lp])


# ---------------------------------------------------------------- GSPO


@PROPERTY
@given(packed_samples(), st.booleans())
def test_gspo_kl_carries_the_masked_sequence_mean_on_every_token(data, use_masks):
    new, old, masks, lengths = data
    if not use_masks:
        masks = [[True] * n for n in lengths]
    got = compute_gspo_kl(
        _t(new),
        _t(old),
        [torch.tensor(m, dtype=torch.bool) for m in masks] if use_masks else None,
        lengths,
    )
    expected = []
    for n_i, o_i, m_i in zip(_split(new, lengths), _split(old, lengths), masks, strict=True):
        expected += [ref_masked_mean([o - n for n, o in zip(n_i, o_i, strict=True)], m_i)] * len(
            n_i
        )
    _assert_matches(got, expected, atol=1e-9)


@PROPERTY
@given(packed_samples(min_samples=1), st.data())
def test_gspo_kl_gradient_per_token_is_minus_one(data, draw):
    new, old, masks, lengths = data
    upstream = draw.draw(st.lists(_floats(-5.0, 5.0), min_size=len(new), max_size=len(new)))
    log_probs = _t(new).requires_grad_()
    old_log_probs = _t(old).requires_grad_()
    ppo_kl = compute_gspo_kl(log_probs, old_log_probs, [_t(m) for m in masks], lengths)
    ppo_kl.backward(_t(upstream))
    _assert_matches(log_probs.grad, [-u for u in upstream])
    assert old_log_probs.grad is None or not bool(old_log_probs.grad.any())


def test_gspo_sample_with_empty_mask_gets_zero():
    got = compute_gspo_kl(
        _t([-1.0, -2.0, -3.0]), _t([-2.0, -2.0, -1.0]), [_t([0, 0]), _t([1])], [2, 1]
    )
    assert got.tolist() == [0.0, 0.0, 2.0]


def test_gspo_rejects_lengths_that_do_not_cover_the_tokens():
    with pytest.raises(
        ValueError, match=r"log_probs \(shape \(3,\)\).*sum\(response_lengths\) \(4\)"
    ):
        compute_gspo_kl(_t([0.0] * 3), _t([0.0] * 3), None, [2, 2])
    with pytest.raises(
        ValueError, match=r"loss_masks lengths \[2, 2\] differ from response_lengths \[1, 2\]"
    ):
        compute_gspo_kl(_t([0.0] * 3), _t([0.0] * 3), [_t([1, 1]), _t([1, 1])], [1, 2])
    with pytest.raises(ValueError, match=r"response_lengths \[4, -1\] must all be >= 0"):
        compute_gspo_kl(_t([0.0] * 3), _t([0.0] * 3), None, [4, -1])


# ---------------------------------------------------------------- TIS, IcePop, MIS


@PROPERTY
@given(st.lists(log_prob_pair(), max_size=8), _floats(0.0, 1.0), _floats(1.0, 10.0))
def test_tis_weights_are_clamped_detached_ratios(pairs, clip_low, clip_high):
    train = _t([p[0] for p in pairs]).requires_grad_()
    got = compute_tis_weights(train, _t([p[1] for p in pairs]), clip_low, clip_high)
    assert not got.requires_grad
    _assert_matches(got, [min(max(_exp(a - b), clip_low), clip_high) for a, b in pairs])


def test_tis_rejects_clip_range_excluding_one():
    with pytest.raises(
        ValueError, match=r"TIS clip range \[0\.5, 0\.9\].*0 <= clip_low <= 1 <= clip_high"
    ):
        compute_tis_weights(_t([0.0]), _t([0.0]), 0.5, 0.9)


@PROPERTY
@given(st.lists(log_prob_pair(), max_size=8), _floats(0.0, 1.0), _floats(1.0, 10.0))
def test_icepop_keeps_ratios_inside_the_band_and_zeroes_the_rest(pairs, low, high):
    train = _t([p[0] for p in pairs]).requires_grad_()
    got = compute_icepop_weights(train, _t([p[1] for p in pairs]), low, high)
    assert not got.requires_grad
    expected = [r if low <= r <= high else 0.0 for r in (_exp(a - b) for a, b in pairs)]
    _assert_matches(got, expected)


def test_icepop_rejects_band_excluding_one():
    with pytest.raises(
        ValueError, match=r"IcePop band \[1\.5, 2\.0\] \(--icepop-low, --tis-clip-high\)"
    ):
        compute_icepop_weights(_t([0.0]), _t([0.0]), 1.5, 2.0)


@PROPERTY
@given(packed_samples(), _floats(1.0, 10.0), st.one_of(st.just(1e-4), _floats(0.0, 1.0)))
def test_mis_weights_match_sequence_ratio_with_veto(data, clip_high, veto):
    train, rollout, masks, lengths = data
    train_t = _t(train).requires_grad_()
    weights, keep = compute_mis_weights(
        train_t, _t(rollout), [torch.tensor(m) for m in masks], lengths, clip_high, veto
    )
    assert not weights.requires_grad
    exp_weights, exp_keep = ref_mis(train, rollout, masks, lengths, clip_high, veto)
    _assert_matches(weights, exp_weights)
    _assert_matches(keep, exp_keep)


def test_mis_one_catastrophic_token_vetoes_its_whole_sample():
    # Sample 0: a trainable token with ratio e^-20 < 1e-4. Sample 1: the same token, but masked.
    train, rollout = _t([-21.0, -1.0, -21.0, -1.0]), _t([-1.0, -1.0, -1.0, -1.0])
    masks = [_t([1, 1]), _t([0, 1])]
    weights, keep = compute_mis_weights(
        train, rollout, masks, [2, 2], clip_high=2.0, veto_threshold=1e-4
    )
    assert keep.tolist() == [0.0, 1.0]
    assert weights.tolist() == [0.0, 0.0, 1.0, 1.0]


def test_mis_sequence_ratio_above_clip_high_vetoes_and_empty_mask_keeps_ratio_one():
    train, rollout = _t([0.0, 0.0, -5.0]), _t([-1.0, -1.0, -1.0])
    weights, keep = compute_mis_weights(train, rollout, [_t([1, 1]), _t([0])], [2, 1], 2.0, 1e-4)
    assert keep.tolist() == [0.0, 1.0]  # exp(1) > 2 vetoes sample 0
    assert weights.tolist() == [0.0, 0.0, 1.0]


def test_mis_rejects_bad_thresholds():
    args = (_t([0.0]), _t([0.0]), [_t([1])], [1])
    with pytest.raises(
        ValueError, match=r"MIS clip_high \(--tis-clip-high\) is 0\.5; it must be >= 1"
    ):
        compute_mis_weights(*args, clip_high=0.5, veto_threshold=1e-4)
    with pytest.raises(
        ValueError,
        match=r"MIS veto_threshold \(--mis-veto-threshold\) is 2\.0; it must be in \[0, 1\]",
    ):
        compute_mis_weights(*args, clip_high=2.0, veto_threshold=2.0)


# ---------------------------------------------------------------- returns, GAE, whitening


@PROPERTY
@given(token_sequences(n_series=1), _floats(0.0, 1.0))
def test_reinforce_plus_plus_returns_match_reference_over_trainable_tokens(data, gamma):
    (rewards,), masks = data
    got = get_reinforce_plus_plus_returns(
        [_t(r) for r in rewards], [torch.tensor(m) for m in masks], gamma
    )
    assert len(got) == len(rewards)
    for g, r, m in zip(got, rewards, masks, strict=True):
        _assert_matches(g, ref_returns(r, m, gamma), atol=1e-9)


def test_masked_tokens_get_zero_return_and_do_not_discount_the_chain():
    # Trainable tokens 0 and 3; the tool tokens 1, 2 (whose reward is ignored) sit between them.
    got = get_reinforce_plus_plus_returns([_t([0.0, 5.0, 5.0, 1.0])], [_t([1, 0, 0, 1])], gamma=0.5)
    assert got[0].tolist() == [0.5, 0.0, 0.0, 1.0]


@PROPERTY
@given(token_sequences(n_series=2), _floats(0.0, 1.0), _floats(0.0, 1.0))
def test_gae_matches_reference_over_trainable_tokens(data, gamma, lam):
    (rewards, values), masks = data
    adv, ret = get_gae_advantages_and_returns(
        [_t(r) for r in rewards],
        [_t(v) for v in values],
        [torch.tensor(m) for m in masks],
        gamma,
        lam,
    )
    assert len(adv) == len(ret) == len(rewards)
    for a, r_, rw, v, m in zip(adv, ret, rewards, values, masks, strict=True):
        exp_adv, exp_ret = ref_gae(rw, v, m, gamma, lam)
        _assert_matches(a, exp_adv, atol=1e-9)
        _assert_matches(r_, exp_ret, atol=1e-9)


def test_gae_bootstraps_across_masked_tokens_from_the_next_trainable_value():
    adv, ret = get_gae_advantages_and_returns(
        [_t([0.0, 9.0, 1.0])], [_t([0.5, 9.0, 0.25])], [_t([1, 0, 1])], gamma=1.0, lam=1.0
    )
    assert adv[0].tolist() == [0.5, 0.0, 0.75]  # token 0: 0 + 0.25 - 0.5 + (1 - 0.25)
    assert ret[0].tolist() == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("fn", ["returns", "gae"])
def test_returns_reject_bad_discount_and_mismatched_samples(fn):
    def call(gamma, masks):
        if fn == "returns":
            return get_reinforce_plus_plus_returns([_t([1.0, 2.0])], masks, gamma)
        return get_gae_advantages_and_returns(
            [_t([1.0, 2.0])], [_t([0.0, 0.0])], masks, gamma, 0.95
        )

    with pytest.raises(ValueError, match=r"gamma \(--gamma\) is 1\.5; it must be in \[0, 1\]"):
        call(1.5, [_t([1, 1])])
    if fn == "gae":
        with pytest.raises(ValueError, match=r"lam \(--lambd\) is -0\.5; it must be in \[0, 1\]"):
            get_gae_advantages_and_returns([_t([1.0])], [_t([0.0])], [_t([1])], 1.0, -0.5)
    with pytest.raises(ValueError, match=r"sample 0: .* have shapes \[\(2,\), .*\(3,\)\]"):
        call(1.0, [_t([1, 1, 1])])
    with pytest.raises(ValueError, match=r"hold \[1, .*2\] samples"):
        call(1.0, [_t([1, 1]), _t([1])])


@PROPERTY
@given(st.data(), st.integers(1, 4), st.integers(0, 6), st.booleans())
def test_whiten_matches_masked_population_reference(data, rows, cols, shift_mean):
    n = rows * cols
    xs = data.draw(st.lists(_floats(-100.0, 100.0), min_size=n, max_size=n))
    mask = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    got = whiten(
        _t(xs).reshape(rows, cols), torch.tensor(mask).reshape(rows, cols), shift_mean=shift_mean
    )
    assert got.shape == (rows, cols)
    _assert_matches(got.reshape(-1), ref_whiten(xs, mask, 1e-8, shift_mean), atol=1e-9)


def test_whiten_with_fewer_than_two_tokens_does_not_divide_and_ignores_masked_garbage():
    x = _t([4.0, math.inf, math.nan])
    mask = torch.tensor([True, False, False])
    assert whiten(x, mask).tolist() == [0.0, 0.0, 0.0]
    assert whiten(x, mask, shift_mean=False).tolist() == [4.0, 0.0, 0.0]
    assert whiten(x, torch.zeros(3, dtype=torch.bool)).tolist() == [0.0, 0.0, 0.0]


def test_whiten_rejects_mask_of_other_shape():
    with pytest.raises(ValueError, match=r"values \(shape \(2,\)\) and mask \(shape \(3,\)\)"):
        whiten(_t([0.0, 1.0]), torch.ones(3))


def test_registries_list_every_estimator_and_kl_type():
    assert KL_TYPES == ("k1", "k2", "k3", "low_var_kl")
    assert tuple(ESTIMATORS) == (
        "grpo",
        "dr_grpo",
        "gspo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "ppo",
    )
