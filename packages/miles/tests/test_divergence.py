"""DivergenceGuard: skipped optimizer steps stop the run at the limit, naming the rollouts and the
last finite step; collapse signals warn once per streak, or stop the run when asked."""

from __future__ import annotations

import json
import logging
import math

import pytest

from miles.utils.divergence import DivergenceError, DivergenceGuard, vocab_size

NAN = math.nan


def _steps(*grad_norms: float, first_step: int = 1) -> list[dict[str, float]]:
    return [
        {"train/step": float(first_step + i), "train/grad_norm": g, "train/loss": 0.5}
        for i, g in enumerate(grad_norms)
    ]


def test_consecutive_skips_across_rollouts_stop_the_run_naming_them_and_the_last_finite_step():
    guard = DivergenceGuard(max_consecutive_nonfinite_steps=3, collapse_window=5)
    guard.record_steps(0, _steps(1.5, NAN))
    guard.check(0, {})
    guard.record_steps(1, _steps(math.inf, first_step=3))
    guard.check(1, {})  # two in a row: still going
    guard.record_steps(2, _steps(NAN, 2.0, first_step=4))
    guard.check(2, {})  # a finite step ends the streak
    guard.record_steps(3, _steps(NAN, NAN, NAN, first_step=6))
    with pytest.raises(DivergenceError) as error:
        guard.check(3, {})
    message = str(error.value)
    assert "3 optimizer steps in a row had a non-finite gradient norm" in message
    assert "rollout 3 step 6, rollout 3 step 7, rollout 3 step 8" in message
    assert "the last finite step (rollout 2): {'train/step': 5.0, 'train/grad_norm': 2.0" in message
    assert "Lower --lr" in message


def test_a_run_that_never_had_a_finite_step_says_so():
    guard = DivergenceGuard(max_consecutive_nonfinite_steps=1, collapse_window=5)
    guard.record_steps(0, _steps(NAN))
    with pytest.raises(DivergenceError, match="no step of this run had a finite gradient norm"):
        guard.check(0, {})


@pytest.mark.parametrize(
    ("metrics", "signal"),
    [
        ({"train/entropy": 0.995 * math.log(259)}, "entropy back at ln(V) = 5.557"),
        ({"train/grad_norm": 0.0}, "gradient norm exactly 0"),
        ({"rollout/reward_min": 0.0, "rollout/reward_max": 0.0}, "every reward at the lowest"),
    ],
)
def test_a_collapse_signal_warns_once_when_it_held_for_the_window(metrics, signal, caplog):
    guard = DivergenceGuard(max_consecutive_nonfinite_steps=3, collapse_window=3, vocab_size=259)
    guard.check(-1, {"train/entropy": 1.0})  # a policy that had learned something
    with caplog.at_level(logging.WARNING, logger="miles.utils.divergence"):
        for rollout_id in range(2):
            guard.check(rollout_id, metrics)
        assert not caplog.records
        for rollout_id in range(2, 6):
            guard.check(rollout_id, metrics)
    (record,) = caplog.records  # once per streak, not every rollout after it
    assert signal in record.message and "through rollout 2" in record.message
    assert "--abort-on-collapse" in record.message


def test_a_random_model_starting_at_uniform_entropy_is_no_collapse(caplog):
    """An untrained model's entropy starts at ln(V): only a return to it after leaving it is."""
    guard = DivergenceGuard(max_consecutive_nonfinite_steps=3, collapse_window=2, vocab_size=259)
    uniform = {"train/entropy": 0.999 * math.log(259), "train/grad_norm": 0.5}
    with caplog.at_level(logging.WARNING, logger="miles.utils.divergence"):
        for rollout_id in range(4):
            guard.check(rollout_id, uniform)
        assert not caplog.records
        guard.check(4, {"train/entropy": 2.0, "train/grad_norm": 0.5})
        for rollout_id in range(5, 7):
            guard.check(rollout_id, uniform)
    (record,) = caplog.records
    assert "entropy back at ln(V)" in record.message and "through rollout 6" in record.message


def test_a_healthy_rollout_resets_the_streak_and_abort_on_collapse_stops():
    guard = DivergenceGuard(
        max_consecutive_nonfinite_steps=3, collapse_window=2, abort_on_collapse=True
    )
    guard.check(0, {"train/grad_norm": 0.0})
    guard.check(1, {"train/grad_norm": 0.3})
    guard.check(2, {"train/grad_norm": 0.0})
    with pytest.raises(DivergenceError, match="gradient norm exactly 0 for 2 rollouts"):
        guard.check(3, {"train/grad_norm": 0.0})


def test_rewards_flat_above_the_lowest_seen_are_no_collapse(caplog):
    guard = DivergenceGuard(max_consecutive_nonfinite_steps=3, collapse_window=2)
    guard.check(0, {"rollout/reward_min": 0.0, "rollout/reward_max": 1.0})
    with caplog.at_level(logging.WARNING, logger="miles.utils.divergence"):
        for rollout_id in range(1, 4):  # every sample right: flat, but at the top
            guard.check(rollout_id, {"rollout/reward_min": 1.0, "rollout/reward_max": 1.0})
    assert not caplog.records


def test_vocab_size_reads_a_local_config_and_skips_a_hub_id(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 259}))
    assert vocab_size(str(tmp_path)) == 259
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 7}}))
    assert vocab_size(str(tmp_path)) == 7
    assert vocab_size("Qwen/Qwen3-0.6B") is None
