"""The sampler never emits a token that top-k, top-p or min-p exclude, and parses SGLang's
sampling_params with clear errors."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.sglang_utils.reference_engine.errors import InvalidRequestError
from miles.backends.sglang_utils.reference_engine.sampling import SamplingParams, sample_next_tokens


def _allowed(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Independent reference: the tokens each filter keeps, from sorted probabilities."""
    scaled = logits.double() / p.temperature
    order = sorted(range(len(scaled)), key=lambda i: -float(scaled[i]))
    keep = set(order)
    if p.top_k > 0:
        kth = float(scaled[order[min(p.top_k, len(order)) - 1]])
        keep = {i for i in keep if float(scaled[i]) >= kth}
    if p.top_p < 1.0:
        probs = torch.softmax(
            torch.where(
                torch.tensor([i in keep for i in range(len(scaled))]),
                scaled,
                torch.tensor(float("-inf"), dtype=torch.float64),
            ),
            -1,
        )
        mass, nucleus = 0.0, set()
        for i in sorted(keep, key=lambda i: -float(probs[i])):
            nucleus.add(i)
            mass += float(probs[i])
            if mass >= p.top_p:
                break
        keep = nucleus
    return keep


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(2, 30),
    top_k=st.one_of(st.just(-1), st.integers(1, 10)),
    top_p=st.floats(0.05, 1.0),
    temperature=st.floats(0.2, 2.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_sampled_tokens_stay_inside_top_k_and_top_p(vocab, top_k, top_p, temperature, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=gen) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    allowed = _allowed(logits, params)
    for draw in range(20):
        tokens, log_probs = sample_next_tokens(logits[None], [params], [random.Random(seed + draw)])
        assert tokens[0] in allowed
        expected = torch.log_softmax(logits / temperature, -1)[tokens[0]]
        assert log_probs[0] == pytest.approx(float(expected), abs=1e-5)


def test_draws_follow_the_temperature_scaled_distribution_and_seeds_repeat_them():
    # 6000 rows of one batch, each with its own seeded generator: the token frequencies are
    # those of softmax(logits / T) (within 5 standard errors), the reported log-probs are that
    # distribution's, and the same seeds give the same draws alone or inside another batch.
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    params = SamplingParams(temperature=0.7)
    rows = 6000
    tokens, log_probs = sample_next_tokens(
        logits.expand(rows, -1),
        [params] * rows,
        [random.Random(s) for s in range(rows)],
    )
    expected = torch.softmax(logits.double() / 0.7, -1)
    counts = torch.bincount(torch.tensor(tokens), minlength=5).double() / rows
    stderr = (expected * (1 - expected) / rows).sqrt()
    assert ((counts - expected).abs() <= 5 * stderr).all(), (counts, expected)
    assert torch.allclose(torch.tensor(log_probs).double(), expected.log()[tokens], atol=1e-5)
    greedy = SamplingParams(temperature=0.0)
    mixed, _ = sample_next_tokens(
        torch.stack([torch.zeros(5), logits]),
        [greedy, params],
        [random.Random(), random.Random(7)],
    )
    assert mixed == [0, tokens[7]]


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, min_p=0.2)  # keeps p >= 0.1
    seen = {
        sample_next_tokens(logits[None], [params], [random.Random(s)])[0][0] for s in range(300)
    }
    assert seen == {0, 1, 2}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"temperature": -1},
            r"^sampling_params.temperature: .* greater than or equal to 0 \(got -1\)",
        ),
        ({"top_p": 0}, r"^sampling_params.top_p: Input should be greater than 0 \(got 0\)"),
        ({"top_k": 0}, r"^sampling_params.top_k: top_k must be -1 \(off\) or >= 1 \(got 0\)"),
        ({"max_new_tokens": -5}, r"^sampling_params.max_new_tokens: .* \(got -5\)"),
        ({"frequency_penalty": 0.5}, r"sampling_params.frequency_penalty=0.5 is not supported"),
        ({"temprature": 1.0}, r"unknown field 'temprature'"),
    ],
)
def test_bad_sampling_params_are_rejected_by_name(raw, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams.from_json(raw)


def test_defaults_of_unsupported_fields_and_string_stop_are_accepted():
    params = SamplingParams.from_json(
        {"frequency_penalty": 0.0, "regex": None, "stop": "\n", "skip_special_tokens": True}
    )
    assert params.stop == ["\n"]
