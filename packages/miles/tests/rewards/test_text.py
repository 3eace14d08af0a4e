"""Exact match and SQuAD F1: hand-computed values and the properties F1 must have."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles.backends.training_utils.batching.sample import Sample
from miles.rollout.rewards import exact_match, exact_match_reward, f1_reward, f1_score, last_boxed


def make_sample(response: str, label: str | None) -> Sample:
    return Sample(prompt="q", tokens=[1, 2, 3], response=response, response_length=1, label=label)


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\fbox{x}", "x"),
        ("\\boxed 7 is it", "7"),
        ("no box", None),
        ("truncated \\boxed{\\frac{1", None),
    ],
)
def test_last_boxed_returns_the_last_brace_matched_answer(text, boxed):
    assert last_boxed(text) == boxed


def test_exact_match_ignores_case_outer_space_and_whitespace_runs():
    assert exact_match("  Paris\n\tFrance ", "paris france") == 1.0
    assert exact_match("Paris", "Paris, France") == 0.0


def test_exact_match_reward_accepts_the_boxed_answer_or_the_whole_response():
    assert exact_match_reward(make_sample("The capital is \\boxed{ Paris }", "paris")) == 1.0
    assert exact_match_reward(make_sample("PARIS", "paris")) == 1.0
    assert exact_match_reward(make_sample("\\boxed{Lyon}", "paris")) == 0.0
    assert exact_match_reward(make_sample("Paris", "\\boxed{Paris}")) == 1.0


def test_f1_matches_hand_computed_values():
    # pred tokens: cat sat on mat (articles dropped); gold: cat sat; common 2
    # precision 2/4, recall 2/2 -> F1 = 2 * 0.5 * 1 / 1.5 = 2/3
    assert f1_score("The cat sat on the mat.", "a cat sat") == pytest.approx(2 / 3)
    # pred: new york city (3), gold: york (1): p=1/3, r=1 -> 0.5
    assert f1_score("New York City!", "York") == pytest.approx(0.5)
    # repeated tokens count by multiplicity: common = min(2, 1) b + min(1, 2) c = 2
    # p = r = 2/3 -> F1 = 2/3
    assert f1_score("b b c", "b c c") == pytest.approx(2 / 3)
    assert f1_score("dog", "cat") == 0.0


def test_f1_of_texts_that_normalize_to_nothing_follows_squad():
    assert f1_score("The!", "a ...") == 1.0  # both empty after normalization
    assert f1_score("the", "cat") == 0.0


def test_f1_reward_scores_the_boxed_answer_when_there_is_one():
    sample = make_sample("Long reasoning about towns... \\boxed{New York}", "new york city")
    assert f1_reward(sample) == pytest.approx(0.8)  # p=1, r=2/3 -> 0.8


def test_text_rewards_without_a_label_raise_naming_the_rm_type():
    with pytest.raises(ValueError, match=r"--rm-type f1 .* sample\.label"):
        f1_reward(make_sample("x", None))
    with pytest.raises(ValueError, match="--rm-type exact_match"):
        exact_match_reward(make_sample("x", None))


words = st.lists(st.sampled_from(["a", "the", "cat", "Cat", "dog", "x,", "run", "1"]), max_size=8)
texts = words.map(" ".join) | st.text(max_size=30)


@given(texts, texts)
def test_f1_is_symmetric_and_in_unit_interval(a, b):
    score = f1_score(a, b)
    assert 0.0 <= score <= 1.0
    assert score == pytest.approx(f1_score(b, a))


@given(texts)
def test_f1_of_a_text_with_itself_is_one(a):
    assert f1_score(a, a) == 1.0
