"""The reward hub: resolves the configured reward once, scores batches concurrently, and applies
the failure rule.

Failure rule (architecture.md: "Design rules"): a sample whose reward function raises, exceeds
`--rm-timeout-s`, or returns something that is not a finite number (or a dict without the reward
key) gets
`--reward-failure-score` as its reward and the message in `sample.metadata["reward_error"]`.
Failures are counted in the `RewardReport` (`reward/failures`, `reward/failure_rate`), logged once
per batch with the count and the first message (its sample and reward named), and the batch goes
on: the hub never raises for a failing reward function. With `--group-rm`, a group whose call fails
fails all its samples. Past `--max-reward-failure-rate` of a rollout the run stops
(`check_failure_rate`, called by the rollout's owner once the rollout is scored).

Magnitudes: `--reward-clip` clips rewards into its bound (counted); without it a reward beyond
`LARGE_REWARD` is kept and warned about, since such scales are usually a reward function's bug
(group normalisation copes with any finite reward).

A row may name its own reward (`metadata["rm_type"]`, `miles.rollout.rewards.sample_reward`):
each sample is scored with the reward its metadata names, else with the run's, and the report
tallies the rewards by name (`reward/<name>/mean`) when any sample named one.

Sync functions run in worker threads (`asyncio.to_thread`), so a slow one does not stall the event
loop; a timed-out thread cannot be killed and runs on in the background, only its result is dropped.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles.backends.training_utils.batching.sample import Sample
from miles.backends.training_utils.infra.import_path import load_function
from miles.rollout.rewards.config import CUSTOM_RM_PATH_FLAG, RewardConfig
from miles.rollout.rewards.math import math_reward
from miles.rollout.rewards.remote import RemoteRewardModel
from miles.rollout.rewards.sample_reward import SampleReward, names_own_reward, sample_reward
from miles.rollout.rewards.text import exact_match_reward, f1_reward

logger = logging.getLogger(__name__)

BUILTIN_REWARDS: dict[str, Callable[[Sample], float]] = {
    "math": math_reward,
    "exact_match": exact_match_reward,
    "f1": f1_reward,
}
"""The rule-based rewards, by `--rm-type`; `remote` and `custom` are resolved from their flags."""
MAX_FAILURE_MESSAGES = 5
"""How many failure messages a `RewardReport` keeps; the count covers all of them."""
_DEFAULT_REWARD_KEY = "reward"
LARGE_REWARD = 1e6
"""Without --reward-clip, rewards beyond this magnitude are warned about (with the sample)."""

# One evaluation's outcome: the reward, or None and the error message.
_Outcome = tuple[float | None, str | None]


class RewardTimeoutError(TimeoutError):
    """One evaluation ran past `--rm-timeout-s`."""


class RewardFailureRateError(RuntimeError):
    """More of a rollout's samples failed their reward than --max-reward-failure-rate allows."""


def check_failure_rate(
    failures: int, scored: int, messages: list[str], *, max_rate: float, rollout_id: int
) -> None:
    """Stop (RewardFailureRateError) when `failures` of `scored` samples exceed `max_rate`; the
    message quotes the first failure `messages`."""
    if scored == 0 or failures / scored <= max_rate:
        return
    quoted = "; ".join(messages[:MAX_FAILURE_MESSAGES])
    raise RewardFailureRateError(
        f"{failures} of {scored} samples of rollout {rollout_id} failed their reward "
        f"({failures / scored:.0%}, above --max-reward-failure-rate {max_rate:g}); first "
        f"failures: {quoted}. Fix the reward function, or raise --max-reward-failure-rate "
        "(1 never stops) to train on --reward-failure-score instead"
    )


@dataclass
class RewardTally:
    """Samples scored by one reward, the mean of their rewards, and how many failed."""

    samples: int = 0
    mean: float = 0.0
    """Kept as a mean, not a sum: a sum of rewards of 1e308 overflows to inf; weighted means
    of finite values never do."""
    failures: int = 0

    def add(self, other: RewardTally) -> None:
        total = self.samples + other.samples
        if total:
            self.mean = self.mean * (self.samples / total) + other.mean * (other.samples / total)
        self.samples = total
        self.failures += other.failures


@dataclass
class RewardReport:
    """Rewards of one scored batch, in input (flattened) order, and what failed."""

    rewards: list[float]
    failures: int = 0
    failure_messages: list[str] = field(default_factory=list)
    """The first `MAX_FAILURE_MESSAGES` messages, each prefixed with the sample's batch position."""
    by_reward: dict[str, RewardTally] = field(default_factory=dict)
    """Tallies by reward name (`SampleReward.name`)."""
    named_own: bool = False
    """Whether a sample named its own reward (`metadata.rm_type`)."""
    clipped: int | None = None
    """Rewards clipped into --reward-clip; None without it."""

    def metrics(self) -> dict[str, float]:
        """`reward/failures` (count) and `reward/failure_rate` (fraction of the batch), by
        reward name (`reward_tally_metrics`) where a sample named its own, and `reward/clipped`
        with --reward-clip."""
        rate = self.failures / len(self.rewards) if self.rewards else 0.0
        tallies = reward_tally_metrics(self.by_reward) if self.named_own else {}
        clipped = {} if self.clipped is None else {"reward/clipped": float(self.clipped)}
        return {
            "reward/failures": float(self.failures), "reward/failure_rate": rate, **tallies,
            **clipped,
        }  # fmt: skip


def reward_tally_metrics(tallies: dict[str, RewardTally]) -> dict[str, float]:
    """`reward/<name>/mean` (failed samples count with their failure score), `/samples` and
    `/failures` of each reward."""
    metrics = {}
    for name, tally in sorted(tallies.items()):
        metrics[f"reward/{name}/mean"] = tally.mean
        metrics[f"reward/{name}/samples"] = float(tally.samples)
        metrics[f"reward/{name}/failures"] = float(tally.failures)
    return metrics


@dataclass
class _Scorer:
    """One reward, resolved: its settings and the function that computes it."""

    config: RewardConfig
    fn: Callable[..., Any]
    is_async: bool
    remote: RemoteRewardModel | None = None


class RewardHub:
    """Scores samples with the reward `config` names; see the module docstring for failures.

    Example::

        hub = RewardHub(RewardConfig(rm_type="math"))
        report = await hub.score(samples)  # sets sample.reward and sample.raw_reward
        tracker.log(report.metrics())
        await hub.aclose()
    """

    def __init__(self, config: RewardConfig):
        self.config = config
        self._run_reward = SampleReward.of_config(config)
        # Resolved on first use: the run's now (a broken --custom-rm-path fails at start), a
        # row's own when a sample names it.
        self._scorers: dict[SampleReward, _Scorer] = {}
        self._scorer(self._run_reward)
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return (
            f"RewardHub(rm_type={self.config.rm_type!r}, fn={self._scorer(self._run_reward).fn!r})"
        )

    async def __aenter__(self) -> RewardHub:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Release the remote reward models' connections, if any."""
        for scorer in self._scorers.values():
            if scorer.remote is not None:
                await scorer.remote.aclose()

    async def score(self, samples: list[Sample]) -> RewardReport:
        """Score `samples`; with `--group-rm`, samples sharing a `group_index` form one call."""
        groups = _groups_by_index(samples) if self.config.group_rm else None
        return await self._score(samples, groups)

    async def score_groups(self, groups: list[list[Sample]]) -> RewardReport:
        """Score groups (one per prompt); the report is in flattened order."""
        flat = [sample for group in groups for sample in group]
        if not self.config.group_rm:
            return await self._score(flat, None)
        positions, start = [], 0
        for group in groups:
            positions.append(list(range(start, start + len(group))))
            start += len(group)
        return await self._score(flat, positions)

    def check_rewards(self, named: dict[SampleReward, str]) -> None:
        """Load every reward the data's rows name (`PromptDataset.own_rewards`: each with the
        first row naming it) before the first rollout; a custom function that cannot be
        imported is an error naming that row."""
        for reward, location in named.items():
            try:
                self._scorer(reward)
            except Exception as err:  # whatever importing the user's module raises
                raise ValueError(f"{location}: its reward {reward.name!r}: {err}") from None

    def _scorer(self, reward: SampleReward) -> _Scorer:
        if reward not in self._scorers:
            self._scorers[reward] = _resolve(reward.config(self.config))
        return self._scorers[reward]

    def _reward_of(self, sample: Sample) -> SampleReward | str:
        """The reward `sample` is scored with, or why its metadata names none that can be."""
        try:
            return sample_reward(sample.metadata, self.config) or self._run_reward
        except ValueError as err:  # the loader checked the rows; a custom rollout may not
            return str(err)

    async def _score(self, samples: list[Sample], groups: list[list[int]] | None) -> RewardReport:
        rewards = [self._reward_of(s) for s in samples]
        outcomes: list[_Outcome] = [(None, "not scored")] * len(samples)
        groups = groups if groups is not None else [[i] for i in range(len(samples))]
        calls, targets = [], []
        for group in groups:
            named = {rewards[i] for i in group}
            reward = named.pop() if len(named) == 1 else None
            if isinstance(reward, SampleReward) and reward.config(self.config).group_rm:
                calls.append(self._evaluate_group([samples[i] for i in group], reward))
                targets.append(group)
                continue
            for i in group:  # one sample at a time, each with its own reward
                calls.append(self._evaluate_one(samples[i], rewards[i]))
                targets.append([i])
        for target, target_outcomes in zip(targets, await asyncio.gather(*calls), strict=True):
            for position, outcome in zip(target, target_outcomes, strict=True):
                outcomes[position] = outcome
        names = [r.name if isinstance(r, SampleReward) else "invalid" for r in rewards]
        report = self._apply(samples, outcomes, names)
        report.named_own = any(names_own_reward(sample.metadata) for sample in samples)
        return report

    def _apply(
        self, samples: list[Sample], outcomes: list[_Outcome], names: list[str]
    ) -> RewardReport:
        """Write rewards onto the samples, the failure score onto failed ones, and report
        (tallied by reward `names`)."""
        clip = self.config.reward_clip
        report = RewardReport(rewards=[], clipped=None if clip is None else 0)
        large: list[str] = []  # beyond LARGE_REWARD, without --reward-clip
        for position, (sample, (reward, error)) in enumerate(zip(samples, outcomes, strict=True)):
            group = "" if sample.group_index is None else f" of group {sample.group_index}"
            where = f"sample {position}{group} (reward {names[position]!r})"
            if error is None:
                assert reward is not None, "an outcome without an error carries a reward"
                sample.metadata.pop("reward_error", None)  # left from an earlier scoring
                if clip is not None and abs(reward) > clip:
                    reward = max(-clip, min(clip, reward))
                    report.clipped = (report.clipped or 0) + 1
                elif clip is None and abs(reward) > LARGE_REWARD:
                    large.append(f"{where}: {reward:g}")
            else:
                reward = self.config.reward_failure_score
                sample.metadata["reward_error"] = error
                report.failures += 1
                if len(report.failure_messages) < MAX_FAILURE_MESSAGES:
                    report.failure_messages.append(f"{where}: {error}")
            sample.reward = sample.raw_reward = reward
            report.rewards.append(reward)
            tally = report.by_reward.setdefault(names[position], RewardTally())
            tally.add(RewardTally(1, reward, int(error is not None)))
        if report.failures:
            logger.warning(
                "%d of %d samples failed their reward (--rm-type %s) and were given "
                "--reward-failure-score %s; first failure: %s",
                report.failures,
                len(samples),
                self.config.rm_type,
                self.config.reward_failure_score,
                report.failure_messages[0],
            )
        if large:
            logger.warning(
                "%d of %d rewards exceed %g in magnitude, e.g. %s; such scales usually mean a "
                "bug in the reward function: bound them with --reward-clip",
                len(large), len(samples), LARGE_REWARD, "; ".join(large[:3]),
            )  # fmt: skip
        return report

    async def _evaluate_one(self, sample: Sample, reward: SampleReward | str) -> list[_Outcome]:
        if isinstance(reward, str):
            return [(None, reward)]
        try:
            scorer = self._scorer(reward)
            value = await self._call(scorer, sample)
            return [(self._to_reward(value, scorer.config), None)]
        except Exception as exc:
            return [(None, self._describe(exc))]

    async def _evaluate_group(self, group: list[Sample], reward: SampleReward) -> list[_Outcome]:
        try:
            scorer = self._scorer(reward)
            values = await self._call(scorer, group)
            if not isinstance(values, list | tuple) or len(values) != len(group):
                got = f"{len(values)} values" if isinstance(values, list | tuple) else repr(values)
                raise TypeError(
                    f"--group-rm reward must return a list with one reward per sample "
                    f"({len(group)}), got {got:.200}"
                )
        except Exception as exc:
            return [(None, self._describe(exc))] * len(group)
        outcomes: list[_Outcome] = []
        for value in values:
            try:
                outcomes.append((self._to_reward(value, scorer.config), None))
            except Exception as exc:
                outcomes.append((None, self._describe(exc)))
        return outcomes

    async def _call(self, scorer: _Scorer, arg: Any) -> Any:
        """The reward function on `arg` under the concurrency bound and `--rm-timeout-s`."""
        # The deadline starts once a slot is free: waiting for a slot is not the function's fault.
        async with self._concurrency_slots():
            try:
                async with asyncio.timeout(self.config.rm_timeout_s) as deadline:
                    return await _invoke(scorer, arg)
            except TimeoutError:
                if not deadline.expired():  # the function's own TimeoutError, not our deadline
                    raise
                raise RewardTimeoutError(
                    f"timed out after {self.config.rm_timeout_s} s (--rm-timeout-s)"
                ) from None

    def _concurrency_slots(self) -> asyncio.Semaphore:
        # A semaphore belongs to one event loop; callers may run each batch in a fresh one.
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:
            self._slots = asyncio.Semaphore(self.config.rm_concurrency)
            self._slots_loop = loop
        return self._slots

    def _to_reward(self, value: Any, config: RewardConfig) -> float:
        if isinstance(value, dict):
            key = config.reward_key or _DEFAULT_REWARD_KEY
            if key not in value:
                raise KeyError(
                    f"reward returned a dict without the key {key!r} (keys: {list(value)[:10]}); "
                    "set --reward-key to the key that holds the reward"
                )
            value = value[key]
        if not isinstance(value, numbers.Real):
            raise TypeError(f"reward returned {type(value).__name__} {value!r:.200}, not a number")
        reward = float(value)
        if not math.isfinite(reward):
            raise ValueError(f"reward returned {reward}, not a finite number")
        return reward

    def _describe(self, exc: Exception) -> str:
        if isinstance(exc, RewardTimeoutError):
            return str(exc)
        return f"{type(exc).__name__}: {exc}"


def _resolve(config: RewardConfig) -> _Scorer:
    """The function computing the reward `config` names (a remote model's client for remote)."""
    if config.rm_type in BUILTIN_REWARDS:
        fn: Callable[..., Any] = BUILTIN_REWARDS[config.rm_type]
        return _Scorer(config, fn, _is_async_callable(fn))
    if config.rm_type == "remote":
        assert config.rm_url is not None, "RewardConfig checks that remote has --rm-url"
        remote = RemoteRewardModel(
            config.rm_url,
            timeout_s=config.rm_timeout_s,
            max_retries=config.rm_max_retries,
            max_connections=config.rm_concurrency,
        )
        fn = remote.score_group if config.group_rm else remote
        return _Scorer(config, fn, _is_async_callable(fn), remote)
    assert config.custom_rm_path is not None, "RewardConfig checks that custom has a path"
    fn = load_reward_function(config.custom_rm_path)
    return _Scorer(config, fn, _is_async_callable(fn))


async def _invoke(scorer: _Scorer, arg: Any) -> Any:
    fn = scorer.fn
    result = fn(arg) if scorer.is_async else await asyncio.to_thread(fn, arg)
    if inspect.isawaitable(result):  # e.g. a sync wrapper that hands back a coroutine
        result = await result
    return result


def load_reward_function(path: str) -> Callable[..., Any]:
    """Import the function `--custom-rm-path` names; errors say what is missing and name the flag."""
    return load_function(path, CUSTOM_RM_PATH_FLAG)


def _groups_by_index(samples: list[Sample]) -> list[list[int]]:
    """Batch positions grouped by `group_index`, in order of first appearance."""
    groups: dict[int | None, list[int]] = {}
    for position, sample in enumerate(samples):
        groups.setdefault(sample.group_index, []).append(position)
    return list(groups.values())


def _is_async_callable(fn: Any) -> bool:
    # iscoroutinefunction sees through functools.partial; a callable object needs its __call__.
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - looking for an async __call__, not callability
    )
