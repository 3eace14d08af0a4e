"""The reward hub: scores rollout samples with a built-in, remote or custom reward (`--rm-type`).

Example::

    from miles.rollout.rewards import RewardConfig, RewardHub

    hub = RewardHub(RewardConfig(rm_type="math"))
    report = await hub.score(samples)  # sets sample.reward / sample.raw_reward
    print(report.rewards, report.metrics())  # {"reward/failures": ..., "reward/failure_rate": ...}
    await hub.aclose()

A reward function that fails never stops the run: see `miles.rollout.rewards.hub` for the rule.
"""

from miles.rollout.rewards.config import BUILTIN_RM_TYPES, RM_TYPES, RewardConfig, RmType
from miles.rollout.rewards.hub import (
    BUILTIN_REWARDS,
    LARGE_REWARD,
    MAX_FAILURE_MESSAGES,
    RewardFailureRateError,
    RewardHub,
    RewardReport,
    RewardTimeoutError,
    load_reward_function,
)
from miles.rollout.rewards.math import math_reward
from miles.rollout.rewards.remote import RemoteRewardError, RemoteRewardModel
from miles.rollout.rewards.text import (
    exact_match,
    exact_match_reward,
    f1_reward,
    f1_score,
    last_boxed,
)

__all__ = [
    "BUILTIN_REWARDS",
    "BUILTIN_RM_TYPES",
    "LARGE_REWARD",
    "MAX_FAILURE_MESSAGES",
    "RM_TYPES",
    "RemoteRewardError",
    "RemoteRewardModel",
    "RewardConfig",
    "RewardFailureRateError",
    "RewardHub",
    "RewardReport",
    "RewardTimeoutError",
    "RmType",
    "exact_match",
    "exact_match_reward",
    "f1_reward",
    "f1_score",
    "last_boxed",
    "load_reward_function",
    "math_reward",
]
