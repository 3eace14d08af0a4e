"""Sample: field invariants, status coercion, derived prompt length and loss mask."""

import pytest

from miles.backends.training_utils.batching.sample import Sample, SampleStatus


def _sample(**overrides):
    fields = dict(index=0, group_index=0, tokens=[1, 2, 3, 4, 5], response_length=2, reward=1.0)
    fields.update(overrides)
    return Sample(**fields)


def test_prompt_length_and_response_tokens_split_tokens_at_response_length():
    sample = _sample()
    assert sample.prompt_length == 3
    assert sample.response_tokens == [4, 5]


def test_effective_loss_mask_is_all_ones_when_loss_mask_is_unset():
    assert _sample().effective_loss_mask == [1, 1]
    assert _sample(loss_mask=[0, 1]).effective_loss_mask == [0, 1]


def test_effective_loss_mask_is_a_copy_that_leaves_the_sample_untouched():
    sample = _sample(loss_mask=[0, 1])
    sample.effective_loss_mask[0] = 1
    assert sample.loss_mask == [0, 1]


def test_status_given_as_string_is_coerced_to_the_enum():
    sample = _sample(status="truncated")
    assert sample.status is SampleStatus.TRUNCATED
    assert sample.status == "truncated"


def test_unknown_status_is_rejected_listing_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"status 'done' is not one of completed, truncated, aborted"
    ):
        _sample(status="done")


def test_response_longer_than_tokens_is_rejected():
    with pytest.raises(
        ValueError, match=r"response_length \(6\) must be between 0 and len\(tokens\) \(5\)"
    ):
        _sample(response_length=6)


def test_negative_response_length_is_rejected():
    with pytest.raises(ValueError, match=r"response_length \(-1\)"):
        _sample(response_length=-1)


def test_rollout_log_probs_need_one_entry_per_response_token():
    with pytest.raises(
        ValueError, match=r"len\(rollout_log_probs\) \(3\) must equal response_length \(2\)"
    ):
        _sample(rollout_log_probs=[-0.1, -0.2, -0.3])


def test_teacher_top_tokens_come_with_their_log_probs_k_per_response_token():
    ok = _sample(
        teacher_top_ids=[[5, 7], [1, 2]], teacher_top_log_probs=[[-0.1, -2.0], [-0.5, -1.5]]
    )
    assert ok.teacher_top_ids == [[5, 7], [1, 2]]
    with pytest.raises(ValueError, match="set both or neither"):
        _sample(teacher_top_ids=[[5], [1]])
    with pytest.raises(
        ValueError, match=r"len\(teacher_top_ids\) \(1\) must equal response_length"
    ):
        _sample(teacher_top_ids=[[5]], teacher_top_log_probs=[[-0.1]])
    with pytest.raises(ValueError, match=r"the same number \(K >= 1\).*got \[1, 2\]"):
        _sample(teacher_top_ids=[[5, 7], [1]], teacher_top_log_probs=[[-0.1, -2.0], [-0.5]])


def test_loss_mask_needs_one_entry_per_response_token():
    with pytest.raises(
        ValueError, match=r"len\(loss_mask\) \(1\) must equal response_length \(2\)"
    ):
        _sample(loss_mask=[1])


def test_loss_mask_holds_only_zeros_and_ones():
    with pytest.raises(ValueError, match=r"loss_mask must hold only 0 and 1, got \[1, 2\]"):
        _sample(loss_mask=[1, 2])


def test_validate_catches_fields_changed_after_construction():
    sample = _sample()
    sample.response_length = 6  # a rollout grew the response but forgot to append its tokens
    with pytest.raises(ValueError, match=r"sample 0: response_length \(6\)"):
        sample.validate()
    sample.tokens.append(6)
    sample.rollout_log_probs = [-1.0, -1.0]  # still sized for the old response
    with pytest.raises(
        ValueError, match=r"len\(rollout_log_probs\) \(2\) must equal response_length \(6\)"
    ):
        sample.validate()


def test_defaults_describe_an_empty_completed_sample():
    sample = Sample()
    assert sample.tokens == [] and sample.response_length == 0
    assert sample.status is SampleStatus.COMPLETED
    assert sample.metadata == {} and sample.metadata is not Sample().metadata


def test_sample_fields_are_keyword_only():
    with pytest.raises(TypeError):
        Sample(0, 0)  # type: ignore[misc]
