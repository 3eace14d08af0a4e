"""Chunked log-probs and entropy equal a float64 log_softmax reference, values and gradients."""

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from miles.backends.training_utils.step.logprobs import get_log_probs_and_entropy


def _reference(logits: np.ndarray, tokens: np.ndarray, temperature: float):
    """Plain float64 NumPy: log-softmax row by row, the targets' entries (one per row, or a row
    of K), and the entropy."""
    log_probs, entropy = [], []
    for row, token in zip(logits.astype(np.float64) / temperature, tokens, strict=True):
        shifted = row - row.max()
        log_z = np.log(np.exp(shifted).sum())
        log_p = shifted - log_z
        log_probs.append(log_p[token])
        entropy.append(-(np.exp(log_p) * log_p).sum())
    return np.array(log_probs), np.array(entropy)


@settings(max_examples=60, deadline=None)
@given(
    num_tokens=st.integers(1, 40),
    vocab=st.integers(2, 50),
    chunk_size=st.integers(1, 16),
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.5]),
    scale=st.sampled_from([1.0, 30.0, 300.0]),
    seed=st.integers(0, 2**31 - 1),
    per_position=st.sampled_from([None, 1, 3]),
)
# Large tempered logits, found by CI: float32 entropy is off by 1.5e-5 there.
@example(
    num_tokens=24, vocab=34, chunk_size=1, temperature=0.3, scale=300.0, seed=398515648,
    per_position=None,
)  # fmt: skip
def test_matches_float64_reference_for_any_chunking(
    num_tokens, vocab, chunk_size, temperature, scale, seed, per_position
):
    """`per_position`: None, one target per position (T,); K, K tokens per position (T, K)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, vocab, generator=gen, dtype=torch.float64) * scale
    shape = (num_tokens,) if per_position is None else (num_tokens, per_position)
    tokens = torch.randint(0, vocab, shape, generator=gen)
    log_probs, entropy = get_log_probs_and_entropy(
        logits, tokens, temperature=temperature, chunk_size=chunk_size
    )
    ref_lp, ref_ent = _reference(logits.numpy(), tokens.numpy(), temperature)
    assert torch.isfinite(log_probs).all() and torch.isfinite(entropy).all()
    np.testing.assert_allclose(
        log_probs.numpy(), ref_lp, rtol=1e-5, atol=1e-4 * max(1.0, scale / 30)
    )
    # float32 keeps ~7 digits of the tempered logits (|logits| / T up to ~3000 here), so the
    # entropy's absolute error grows with their magnitude like the log-probs' does.
    np.testing.assert_allclose(
        entropy.numpy(), ref_ent, rtol=1e-5, atol=1e-5 * max(1.0, scale / (30 * temperature))
    )


@settings(max_examples=30, deadline=None)
@given(
    num_tokens=st.integers(1, 12),
    vocab=st.integers(2, 9),
    chunk_size=st.integers(1, 5),
    temperature=st.sampled_from([0.5, 1.0, 2.0]),
    weights=st.tuples(st.floats(-2, 2), st.floats(-2, 2)),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    per_position=st.sampled_from([None, 1, 4]),
)
def test_gradient_equals_autograd_through_plain_log_softmax(
    num_tokens, vocab, chunk_size, temperature, weights, seed, dtype, per_position
):
    gen = torch.Generator().manual_seed(seed)
    base = (torch.randn(num_tokens, vocab, generator=gen, dtype=torch.float64) * 3).to(dtype)
    # K tokens per position may repeat one another: their gradients add up.
    shape = (num_tokens,) if per_position is None else (num_tokens, per_position)
    tokens = torch.randint(0, vocab, shape, generator=gen)
    upstream_lp = torch.randn(shape, generator=gen, dtype=torch.float64)
    upstream_ent = torch.randn(num_tokens, generator=gen, dtype=torch.float64)

    ours = base.clone().requires_grad_(True)
    lp, ent = get_log_probs_and_entropy(
        ours, tokens, temperature=temperature, chunk_size=chunk_size
    )
    (
        weights[0] * (lp.double() * upstream_lp).sum()
        + weights[1] * (ent.double() * upstream_ent).sum()
    ).backward()

    # The caller's logits are left as they were (float32 ones once got divided in place).
    assert torch.equal(ours.detach(), base)
    plain = base.double().requires_grad_(True)
    log_p = torch.log_softmax(plain / temperature, dim=-1)
    ref_lp = log_p.gather(-1, tokens.view(num_tokens, -1)).view(shape)
    ref_ent = -(log_p.exp() * log_p).sum(-1)
    (
        weights[0] * (ref_lp * upstream_lp).sum() + weights[1] * (ref_ent * upstream_ent).sum()
    ).backward()

    tolerance = (
        {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    )
    torch.testing.assert_close(ours.grad.double(), plain.grad, **tolerance)


def test_bf16_logits_get_float32_outputs_and_bf16_gradients():
    logits = torch.randn(7, 11, dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.randint(0, 11, (7,))
    log_probs, entropy = get_log_probs_and_entropy(logits, tokens, chunk_size=3)
    assert log_probs.dtype == entropy.dtype == torch.float32
    log_probs.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def test_only_log_probs_used_in_the_loss_still_backpropagates():
    logits = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    tokens = torch.tensor([0, 1, 2, 3, 4])
    log_probs, _ = get_log_probs_and_entropy(logits, tokens, chunk_size=2)
    log_probs.sum().backward()
    expected = torch.nn.functional.one_hot(tokens, 6).double() - torch.softmax(logits.detach(), -1)
    torch.testing.assert_close(logits.grad, expected)


@pytest.mark.parametrize(
    ("logits_shape", "tokens_shape", "kwargs", "message"),
    [
        (
            (2, 3, 4),
            (2, 3),
            {},
            r"expected logits \(T, V\) and tokens \(T,\) or \(T, K\), got logits \(2, 3, 4\)",
        ),
        ((4, 5), (3,), {}, r"got logits \(4, 5\) and tokens \(3,\)"),
        ((4, 5), (4, 2, 1), {}, r"got logits \(4, 5\) and tokens \(4, 2, 1\)"),
        ((4, 5), (4,), {"temperature": 0.0}, r"temperature must be > 0 .* got 0.0"),
        ((4, 5), (4,), {"chunk_size": 0}, r"chunk_size must be >= 1, got 0"),
    ],
)
def test_bad_input_is_rejected_with_the_values(logits_shape, tokens_shape, kwargs, message):
    with pytest.raises(ValueError, match=message):
        get_log_probs_and_entropy(
            torch.zeros(logits_shape), torch.zeros(tokens_shape, dtype=torch.long), **kwargs
        )
