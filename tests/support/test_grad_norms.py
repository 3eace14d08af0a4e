"""check_grad_norm: recording per-step gradient norms and comparing a later run against them."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.grad_norms import GradNormMismatch, GradNormStepMissing, check_grad_norm


def test_save_records_each_step_and_keeps_earlier_ones(tmp_path):
    path = tmp_path / "ref" / "grad_norms.json"
    check_grad_norm(1.5, path=path, step=1, mode="save")
    check_grad_norm(0.75, path=str(path), step=0, mode="save")
    check_grad_norm(2.0, path=path, step=1, mode="save")  # a rerun replaces its own step
    assert json.loads(path.read_text()) == {"0": 0.75, "1": 2.0}
    assert list(json.loads(path.read_text())) == ["0", "1"]
    assert [p.name for p in path.parent.iterdir()] == ["grad_norms.json"]  # no temp file left


def test_compare_accepts_norms_within_rtol_and_rejects_others_with_both_values(tmp_path):
    path = tmp_path / "grad_norms.json"
    check_grad_norm(2.0, path=path, step=3, mode="save")
    check_grad_norm(2.05, path=path, step=3, mode="compare")  # 2.5% off, rtol 3%
    with pytest.raises(GradNormMismatch) as error:
        check_grad_norm(2.2, path=path, step=3, mode="compare")
    message = str(error.value)
    assert "grad norm of step 3 is 2.2, reference 2.0" in message
    assert "relative difference 0.1 > rtol 0.03" in message
    assert isinstance(error.value, AssertionError)
    check_grad_norm(2.2, path=path, step=3, rtol=0.2, mode="compare")


@given(
    reference=st.floats(1e-6, 1e6),
    ratio=st.floats(0.5, 1.5),
    rtol=st.sampled_from([0.0, 0.01, 0.03, 0.1]),
)
def test_compare_fails_exactly_when_the_relative_difference_exceeds_rtol(
    tmp_path_factory, reference, ratio, rtol
):
    path = tmp_path_factory.mktemp("norms") / "grad_norms.json"
    check_grad_norm(reference, path=path, step=0, mode="save")
    current = reference * ratio
    mismatch = abs(current - reference) > rtol * reference
    if mismatch:
        with pytest.raises(GradNormMismatch):
            check_grad_norm(current, path=path, step=0, rtol=rtol, mode="compare")
    else:
        check_grad_norm(current, path=path, step=0, rtol=rtol, mode="compare")


def test_a_non_finite_norm_always_mismatches_and_is_never_saved(tmp_path):
    path = tmp_path / "grad_norms.json"
    check_grad_norm(1.0, path=path, step=0, mode="save")
    for value in (math.nan, math.inf):
        with pytest.raises(GradNormMismatch, match=f"step 0 is {value}"):
            check_grad_norm(value, path=path, step=0, mode="compare")
        with pytest.raises(ValueError, match="non-finite norm is no reference"):
            check_grad_norm(value, path=path, step=1, mode="save")


def test_zero_reference_matches_only_zero(tmp_path):
    path = tmp_path / "grad_norms.json"
    check_grad_norm(0.0, path=path, step=0, mode="save")
    check_grad_norm(0.0, path=path, step=0, mode="compare")
    with pytest.raises(GradNormMismatch, match="relative difference inf"):
        check_grad_norm(1e-9, path=path, step=0, mode="compare")


def test_missing_step_is_a_key_error_listing_the_recorded_steps(tmp_path):
    path = tmp_path / "grad_norms.json"
    for step in (0, 2):
        check_grad_norm(1.0, path=path, step=step, mode="save")
    with pytest.raises(KeyError) as error:
        check_grad_norm(1.0, path=path, step=1, mode="compare")
    assert isinstance(error.value, GradNormStepMissing)
    assert str(error.value) == (
        f"{path} has no grad norm for step 1 (recorded steps: [0, 2]); the reference run must "
        "save every step that is compared"
    )


def test_compare_without_a_reference_file_says_to_save_first(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"record them first with .*mode='save'"):
        check_grad_norm(1.0, path=tmp_path / "absent.json", step=0, mode="compare")


def test_bad_arguments_and_corrupt_files_are_rejected(tmp_path):
    path = tmp_path / "grad_norms.json"
    with pytest.raises(ValueError, match="mode must be 'save' or 'compare', got 'check'"):
        check_grad_norm(1.0, path=path, step=0, mode="check")
    with pytest.raises(ValueError, match=r"rtol must be >= 0, got -0\.1"):
        check_grad_norm(1.0, path=path, step=0, rtol=-0.1, mode="save")
    path.write_text("[1.0]")
    with pytest.raises(ValueError, match=r"holds a list, expected a JSON object"):
        check_grad_norm(1.0, path=path, step=0, mode="compare")
    path.write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        check_grad_norm(1.0, path=path, step=0, mode="save")
