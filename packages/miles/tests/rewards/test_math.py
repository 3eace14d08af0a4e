"""`--rm-type math`: math-verify equivalence, run through the hub's worker threads."""

from __future__ import annotations

import asyncio

import pytest

from miles.backends.training_utils.batching.sample import Sample
from miles.rollout.rewards import RewardConfig, RewardHub, math_reward


def make_sample(response: str, label: str | None) -> Sample:
    return Sample(prompt="q", tokens=[1, 2, 3], response=response, response_length=1, label=label)


CASES = [
    ("\\boxed{42}", "42", 1.0),
    ("The answer is $\\boxed{42}$.", "42", 1.0),
    ("1/2", "0.5", 1.0),
    ("so \\boxed{\\frac{6}{8}}", "3/4", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("$\\sqrt{2}$", "\\sqrt{2}", 1.0),  # a bare LaTeX label
    ("\\boxed{2, 3}", "2,3", 1.0),  # a set, not the decimal 2.3
    ("\\boxed{41}", "42", 0.0),
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("I have no idea.", "42", 0.0),  # nothing to parse: wrong, not a failure
    ("", "42", 0.0),
]


@pytest.mark.parametrize(("response", "label", "reward"), CASES)
def test_math_reward_verifies_equivalent_answers(response, label, reward):
    assert math_reward(make_sample(response, label)) == reward


def test_math_reward_works_off_the_main_thread_through_the_hub():
    # math-verify's default signal.alarm timeouts raise outside the main thread; the hub runs
    # sync rewards in worker threads, so every case must still score (and none may fail).
    samples = [make_sample(response, label) for response, label, _ in CASES]
    report = asyncio.run(RewardHub(RewardConfig(rm_type="math")).score(samples))
    assert report.failures == 0, report.failure_messages
    assert report.rewards == [reward for _, _, reward in CASES]
    assert [s.reward for s in samples] == report.rewards
    assert [s.raw_reward for s in samples] == report.rewards


def test_math_reward_without_a_usable_label_is_a_counted_failure():
    samples = [make_sample("\\boxed{1}", None), make_sample("\\boxed{1}", "  ")]
    report = asyncio.run(RewardHub(RewardConfig(rm_type="math")).score(samples))
    assert report.failures == 2
    assert "sample.label" in samples[0].metadata["reward_error"]
    assert "no answer in the label" in samples[1].metadata["reward_error"]
