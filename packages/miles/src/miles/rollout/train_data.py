"""From scored groups to the train data of one rollout: shaped rewards, columns, one shard per DP rank.

Rewards are shaped over the whole rollout here (group normalization needs every sample of a group),
so a train rank only ever sees its own shard (architecture.md: "Contracts / Data"). Rollout metrics
are computed on the same samples, before sharding.
"""

from __future__ import annotations

import math
import statistics

import torch

from miles.backends.training_utils.algorithms.algorithm import shape_rewards
from miles.backends.training_utils.algorithms.loss_config import LossConfig
from miles.backends.training_utils.batching.rollout_data import (
    RolloutBatch,
    samples_to_rollout_batch,
    split_rollout_batch_by_dp,
)
from miles.backends.training_utils.batching.sample import Sample, SampleStatus
from miles.backends.training_utils.batching.train_batches import dp_partitions
from miles.rollout.mixture import SOURCE_KEY


def build_train_data(
    groups: list[list[Sample]], loss: LossConfig, *, dp_size: int, balance: bool = True
) -> list[RolloutBatch]:
    """One `RolloutBatch` per data-parallel rank; every sample in exactly one of them.

    Groups must all have the same size (the estimator's group). `balance` splits by token count
    (near-equal work per rank) instead of round-robin.
    """
    if not groups:
        raise ValueError("the rollout has no groups to train on")
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(
            f"groups of a rollout must have equal sizes (--n-samples-per-prompt), got {sorted(sizes)}"
        )
    group_size = sizes.pop()
    samples = [s for group in groups for s in group]
    for position, sample in enumerate(samples):
        sample.index = position  # unique within the rollout, in group order
    raw = torch.tensor([_reward(s) for s in samples], dtype=torch.float64)  # (N,)
    shaped = shape_rewards(raw, loss, group_size=group_size)  # (N,)
    _check_fits_float32(samples, raw, shaped, loss.advantage_estimator)
    batch = samples_to_rollout_batch(samples, shaped.tolist())
    partitions = dp_partitions(batch["total_lengths"], dp_size, balance)
    return split_rollout_batch_by_dp(batch, dp_size, partitions)


def _check_fits_float32(
    samples: list[Sample], raw: torch.Tensor, shaped: torch.Tensor, estimator: str
) -> None:
    """The trainer spreads shaped rewards over float32 per-token tensors: a value beyond float32's
    range would train as inf (and NaN), so it is refused here, before any rank sees it."""
    limit = torch.finfo(torch.float32).max
    beyond = (shaped.abs() > limit).nonzero()
    if len(beyond):
        i = int(beyond[0, 0])
        raise ValueError(
            f"sample {i} (group {samples[i].group_index}) has reward {raw[i].item():g}, "
            f"{shaped[i].item():g} as --advantage-estimator {estimator} shapes it, beyond the "
            f"float32 range ({limit:g}) of the trainer's per-token advantages ({len(beyond)} "
            "such samples); bound the rewards with --reward-clip"
        )


def _reward(sample: Sample) -> float:
    if sample.reward is None:
        raise ValueError(
            f"sample {sample.index} (group {sample.group_index}) has no reward; the reward hub "
            "scores every sample before training"
        )
    return float(sample.reward)


def rollout_metrics(groups: list[list[Sample]], prefix: str = "rollout") -> dict[str, float]:
    """Reward, response-length and status statistics of a rollout (or an evaluation)."""
    samples = [s for group in groups for s in group]
    if not samples:
        return {}
    rewards = [float(s.reward) for s in samples if s.reward is not None]
    lengths = [s.response_length for s in samples]
    spread = [len({s.reward for s in g}) > 1 for g in groups]
    metrics = {
        f"{prefix}/reward_mean": _mean(rewards) if rewards else float("nan"),
        f"{prefix}/response_len_mean": statistics.fmean(lengths),
        f"{prefix}/response_len_max": float(max(lengths)),
        f"{prefix}/truncated_ratio": _ratio(samples, SampleStatus.TRUNCATED),
        f"{prefix}/aborted_ratio": _ratio(samples, SampleStatus.ABORTED),
        f"{prefix}/failed_ratio": _ratio(samples, SampleStatus.FAILED),
        f"{prefix}/groups_with_reward_spread": sum(spread) / len(groups),
        f"{prefix}/samples": float(len(samples)),
        f"{prefix}/response_tokens": float(sum(lengths)),
    }
    # A mixture's samples name their source (miles.rollout.mixture): each one's own numbers.
    sources: dict[str, list[Sample]] = {}
    for sample in samples:
        if SOURCE_KEY in sample.metadata:
            sources.setdefault(str(sample.metadata[SOURCE_KEY]), []).append(sample)
    for name, members in sorted(sources.items()):
        scored = [float(s.reward) for s in members if s.reward is not None]
        metrics[f"{prefix}/{name}/reward_mean"] = _mean(scored) if scored else math.nan
        metrics[f"{prefix}/{name}/samples"] = float(len(members))
    # Multi-turn samples (tool rollouts, agent sessions) say how many model turns they took.
    turns = [s.metadata["turns"] for s in samples if "turns" in s.metadata]
    if turns:
        metrics[f"{prefix}/turns_mean"] = statistics.fmean(turns)
    return metrics


def _mean(values: list[float]) -> float:
    """statistics.fmean that never overflows: when the sum leaves float's range (rewards of
    1e308: "intermediate overflow in fsum"), the values are scaled by their largest magnitude."""
    try:
        return statistics.fmean(values)
    except OverflowError:
        scale = max(abs(v) for v in values)
        return statistics.fmean([v / scale for v in values]) * scale


def _ratio(samples: list[Sample], status: SampleStatus) -> float:
    return sum(s.status == status for s in samples) / len(samples)


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k from n samples of which `correct` are right (Chen et al., 2021, eq. 1):
    1 - C(n - c, k) / C(n, k), computed as a stable product."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(
            f"pass@k needs 0 <= correct <= n and 1 <= k <= n, got {n=} {correct=} {k=}"
        )
    if n - correct < k:
        return 1.0
    failure = 1.0
    for i in range(n - correct + 1, n + 1):
        failure *= 1.0 - k / i
    return 1.0 - failure


def eval_metrics(
    groups: list[list[Sample]], name: str, ks: tuple[int, ...] | None = None
) -> dict[str, float]:
    """Mean reward, lengths and pass@k of one evaluation dataset, for each k of `ks` (default: 1
    and the group size).

    A sample counts as correct when its reward is at least 1 (the rule-based rewards score a right
    answer 1); partial credit (F1) counts in the mean reward only.
    """
    metrics = rollout_metrics(groups, prefix=f"eval/{name}")
    n = len(groups[0]) if groups else 0
    for k in sorted({1, n} - {0}) if ks is None else ks:
        values = [pass_at_k(len(g), sum((s.reward or 0.0) >= 1.0 for s in g), k) for g in groups]
        metrics[f"eval/{name}/pass@{k}"] = statistics.fmean(values)
    return metrics
