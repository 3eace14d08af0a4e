"""A rollout's train data and metrics from rewards of any finite magnitude: 1e308 for half the
samples crashed the rollout's mean (`intermediate overflow in fsum`) and 1e200 trained on zero
advantages."""

from __future__ import annotations

import pytest

from miles.backends.training_utils.algorithms.loss_config import LossConfig
from miles.backends.training_utils.batching.sample import Sample
from miles.rollout.train_data import build_train_data, rollout_metrics


def _groups(rewards: list[float], group_size: int) -> list[list[Sample]]:
    samples = [
        Sample(prompt="q", tokens=[1, 2, 3], response="r", response_length=1, reward=reward,
               loss_mask=[1], group_index=i // group_size)
        for i, reward in enumerate(rewards)
    ]  # fmt: skip
    return [samples[i : i + group_size] for i in range(0, len(samples), group_size)]


@pytest.mark.parametrize("large", [1e308, 1e200])
def test_huge_rewards_give_the_advantages_and_the_mean_of_their_proportions(large):
    groups = _groups([large, 0.0] * 4, group_size=4)
    (shard,) = build_train_data(groups, LossConfig(advantage_estimator="grpo"), dp_size=1)
    (reference,) = build_train_data(
        _groups([1.0, 0.0] * 4, group_size=4), LossConfig(advantage_estimator="grpo"), dp_size=1
    )
    # Equal but for eps, which is 1e-6 of a reward of 1 and nothing of `large`.
    assert shard["rewards"] == pytest.approx(reference["rewards"], rel=1e-5)
    assert all(abs(r) > 0.8 for r in shard["rewards"]), "no zero advantage"
    assert rollout_metrics(groups)["rollout/reward_mean"] == pytest.approx(large / 2, rel=1e-12)


def test_a_group_spread_past_the_largest_float_is_refused_naming_the_fix():
    groups = _groups([1.7e308, -1.7e308, -1.7e308, -1.7e308], group_size=4)
    with pytest.raises(ValueError, match=r"spread beyond the largest float.*--reward-clip"):
        build_train_data(groups, LossConfig(advantage_estimator="rloo"), dp_size=1)
    assert rollout_metrics(groups)["rollout/reward_mean"] == pytest.approx(-0.85e308)


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus"])
def test_a_shaped_reward_beyond_float32_is_refused_before_training_naming_the_sample(estimator):
    # GRPO's ratios fit any magnitude; a baseline difference or a raw reward of 1e200 does not
    # fit the float32 per-token advantages, where it would train as inf.
    groups = _groups([1e200, 0.0, 0.0, 0.0], group_size=4)
    with pytest.raises(ValueError, match=r"sample 0 \(group 0\) has reward 1e\+200") as error:
        build_train_data(groups, LossConfig(advantage_estimator=estimator), dp_size=1)
    assert f"--advantage-estimator {estimator}" in str(error.value)
    assert "--reward-clip" in str(error.value)
