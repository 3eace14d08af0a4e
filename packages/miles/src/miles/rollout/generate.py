"""The rollout function: sample `n_samples_per_prompt` answers for each prompt, score each group as
soon as it is complete, keep the groups the dynamic filter accepts, and return exactly
`rollout_batch_size` of them.

With a filter, prompts are submitted in rounds of `over_sampling_batch_size` whenever the groups
kept plus those still generating could no longer fill the batch. Once the batch is full the
leftover requests are aborted; with `--partial-rollout` the unfinished groups (and finished
surplus ones) go back to the data source, to be continued by the next rollout.
"""

from __future__ import annotations

import asyncio
import copy
import enum
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from miles.backends.training_utils.import_path import load_function
from miles.backends.training_utils.sample import Sample, SampleStatus
from miles.rollout.engine_pool import EngineLostError, EnginePool, EngineUnavailableError
from miles.rollout.filters import GroupFilter, keep_group, resolve_filter
from miles.rollout.rollout_config import GENERATE_FLAG, RolloutConfig
from miles.rollout.sample_generation import (
    GenerateFunction,
    append_response,
    generate_sample,
    needs_generation,
)

if TYPE_CHECKING:
    from miles.config.miles_config import MilesConfig

__all__ = [
    "DataSource",
    "GroupOutcome",
    "RolloutConfig",
    "RolloutOutput",
    "ScoreGroups",
    "generate_groups",
    "generate_rollout",
    "group_runner",
    "sample_generator",
]

logger = logging.getLogger(__name__)

# While leftovers drain, abort again this often: a request still on the wire when the previous
# abort landed would otherwise run to its full length.
_ABORT_POLL_S = 0.5
# A group sent again this often has met more dead engines than a run survives: the engines'
# supervisor stops the run long before (--max-engine-restarts), except behind a router, where a
# request cannot tell which engine failed it.
_MAX_GROUP_REISSUES = 8


@dataclass
class RolloutOutput:
    """The kept groups, in the order their prompts were submitted, and the rollout's metrics."""

    groups: list[list[Sample]]
    metrics: dict[str, float]


class DataSource(Protocol):
    """Where prompts come from (miles.rollout.data_source.RolloutDataSource)."""

    def get_samples(self, num_prompts: int) -> list[list[Sample]]: ...

    def add_samples(self, groups: list[list[Sample]]) -> None: ...


ScoreGroups = Callable[[list[list[Sample]]], Awaitable[Any]]
"""Sets `sample.reward` on every sample of the groups (the reward hub's `score_groups`)."""


async def generate_rollout(
    rollout_id: int,
    *,
    pool: EnginePool,
    data_source: DataSource,
    score_groups: ScoreGroups,
    config: MilesConfig,
) -> RolloutOutput:
    """The built-in rollout function, the default of --rollout-function-path (and called exactly
    like a custom one): `generate_groups` with the run's rollout settings."""
    return await generate_groups(
        pool, data_source, score_groups, config.rollout, rollout_id=rollout_id
    )


async def sample_generator(rollout_function: Any, config: MilesConfig) -> GenerateFunction | None:
    """How `rollout_function` makes one sample, where it says so, for evaluation to make held-out
    samples the same way (a multi-turn rollout is evaluated over multi-turn exchanges).

    A rollout function says so with a `sample_generator` attribute: a function of the run's
    config returning a GenerateFunction, or an awaitable of one (e.g. the tool rollout's
    `ToolAgent.generate`). None: it does not say, and a sample is made the built-in way
    (--custom-generate-function-path, else one /generate call)."""
    make = getattr(rollout_function, "sample_generator", None)
    if make is None:
        return None
    generate_fn = make(config)
    if inspect.isawaitable(generate_fn):
        generate_fn = await generate_fn
    return generate_fn


async def generate_groups(
    pool: EnginePool,
    data_source: DataSource,
    score_groups: ScoreGroups,
    config: RolloutConfig,
    *,
    rollout_id: int,
    generate_fn: GenerateFunction | None = None,
) -> RolloutOutput:
    """Generate rollout `rollout_id`: exactly `config.rollout_batch_size` scored, kept groups.

    Groups come back in submission (prompt) order, not completion order, so that the training
    batch does not depend on which request happened to finish first. `generate_fn` makes each
    sample (default: --custom-generate-function-path, else one /generate call).
    """
    rollout = _Rollout(pool, data_source, score_groups, config, generate_fn)
    return await rollout.run(rollout_id)


def group_runner(
    pool: EnginePool,
    data_source: DataSource,
    score_groups: ScoreGroups,
    config: RolloutConfig,
    *,
    generate_fn: GenerateFunction | None = None,
) -> Callable[[list[Sample]], Awaitable[GroupOutcome]]:
    """Run one group at a time exactly as `generate_groups` runs each of its groups: generate
    (sent again from its start when an engine is lost), score, filter. For rollouts that are
    not made one batch at a time (the fully-async buffer)."""
    return _Rollout(pool, data_source, score_groups, config, generate_fn).run_group


class GroupOutcome(enum.Enum):
    """How one group's generation ended."""

    KEPT = "kept"
    FILTERED = "filtered"
    ABORTED = "aborted"  # some sample's generation was aborted
    UNSCORED = "unscored"  # finished after the batch was full: left over as it is


class _Rollout:
    """The state of one generate_groups call: submitted groups, their tasks, the counters."""

    def __init__(
        self,
        pool: EnginePool,
        data_source: DataSource,
        score_groups: ScoreGroups,
        config: RolloutConfig,
        generate_fn: GenerateFunction | None,
    ):
        """`generate_fn` makes each sample (default: --custom-generate-function-path, else one
        /generate call)."""
        if generate_fn is None:
            generate_fn = generate_sample
            if config.custom_generate_function_path:
                generate_fn = load_function(config.custom_generate_function_path, GENERATE_FLAG)
        self.pool = pool
        self.data_source = data_source
        self.score_groups = score_groups
        self.config = config
        self.generate_fn = generate_fn
        self.group_filter: GroupFilter | None = None
        if config.dynamic_sampling_filter_path:
            self.group_filter = resolve_filter(config.dynamic_sampling_filter_path)
        self.base_params = config.sampling_params()
        self.slots = asyncio.Semaphore(config.rollout_concurrency)
        self.stopping = False
        self.groups: list[list[Sample]] = []  # every submitted group, by submission position
        self.tasks: dict[asyncio.Task[GroupOutcome], int] = {}  # running group -> its position
        self.kept: list[int] = []
        self.leftover: list[int] = []
        self.counts = dict.fromkeys(
            ("rounds", "filtered_groups", "aborted_groups", "resumed_samples", "reissued_groups"),
            0,
        )
        self.engine_aborted = 0  # groups aborted by the engines, not by this rollout

    async def run(self, rollout_id: int) -> RolloutOutput:
        start = time.monotonic()
        target = self.config.rollout_batch_size
        try:
            while len(self.kept) < target:
                self._top_up(rollout_id)
                done, _ = await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    self._record(self.tasks.pop(task), task.result())
            await self._drain_leftovers(rollout_id)
        except BaseException:
            await self._cancel()
            raise
        self._hand_back_leftovers(rollout_id)
        kept = [self.groups[position] for position in sorted(self.kept)]
        return RolloutOutput(kept, self._metrics(kept, time.monotonic() - start))

    def _top_up(self, rollout_id: int) -> None:
        """Submit a round of prompts if the kept and still-running groups cannot fill the batch."""
        target = self.config.rollout_batch_size
        if len(self.kept) + len(self.tasks) >= target:
            return
        if self.group_filter is None:
            count = target - len(self.kept) - len(self.tasks)
        else:
            count = self.config.prompts_per_round
        groups = self.data_source.get_samples(count)
        if not groups:
            raise RuntimeError(
                f"rollout {rollout_id}: the data source returned no prompts with "
                f"{len(self.kept)} of {target} groups kept (--rollout-batch-size)"
            )
        self.counts["rounds"] += 1
        if self.counts["rounds"] > 1:
            logger.info(
                "rollout %d: round %d submits %d prompts (kept %d/%d, running %d, filtered %d)",
                rollout_id, self.counts["rounds"], len(groups), len(self.kept), target,
                len(self.tasks), self.counts["filtered_groups"],
            )  # fmt: skip
        for group in groups:
            self._check_group(group)
            self.counts["resumed_samples"] += sum(
                s.status == SampleStatus.ABORTED and s.response_length > 0 for s in group
            )
            self.groups.append(group)
            task = asyncio.create_task(self.run_group(group))
            self.tasks[task] = len(self.groups) - 1

    def _check_group(self, group: list[Sample]) -> None:
        if len(group) != self.config.n_samples_per_prompt:
            raise ValueError(
                f"the data source returned a group of {len(group)} samples (group_index "
                f"{group[0].group_index if group else None}) but --n-samples-per-prompt is "
                f"{self.config.n_samples_per_prompt}; build the data source with the same value"
            )

    def _record(self, position: int, outcome: GroupOutcome) -> None:
        """Account for a finished group task while the batch is still filling."""
        if outcome is GroupOutcome.KEPT and len(self.kept) < self.config.rollout_batch_size:
            self.kept.append(position)
        elif outcome is GroupOutcome.FILTERED:
            self.counts["filtered_groups"] += 1
        elif outcome is GroupOutcome.ABORTED:
            # Not asked for by this rollout: an engine was paused in abort mode or failed a step.
            self.counts["aborted_groups"] += 1
            self.engine_aborted += 1
            self.leftover.append(position)
            self._check_engine_aborts()
        else:  # kept beyond the batch (several groups finished at once)
            self.leftover.append(position)

    def _check_engine_aborts(self) -> None:
        # Every engine-aborted group is replaced by a new prompt; an engine that aborts everything
        # would turn that into a busy loop through the data set.
        limit = 4 * self.config.prompts_per_round + self.config.rollout_concurrency
        if self.engine_aborted > limit:
            raise RuntimeError(
                f"the engines aborted {self.engine_aborted} groups of this rollout that it did not "
                "abort itself; are they paused in abort mode or failing? Read the engine logs"
            )

    async def run_group(self, group: list[Sample]) -> GroupOutcome:
        """Generate, score and filter one group. When an engine dies under it, the whole group
        is sent again from where it started, so its samples share one policy and one attempt."""
        if not self.pool.fault_tolerant:
            return await self._run_group_attempt(group)
        start = copy.deepcopy(group)
        for attempt in range(1, _MAX_GROUP_REISSUES + 1):
            try:
                return await self._run_group_attempt(group)
            except EngineLostError as err:
                group[:] = copy.deepcopy(start)
                self.counts["reissued_groups"] += 1
                logger.warning("group %s sent again (attempt %d): %s",
                               group[0].group_index, attempt + 1, err)  # fmt: skip
                if self.pool.router_url is not None:
                    # The router may pick the dead engine again until a health check removes it.
                    await asyncio.sleep(min(0.5 * attempt, 5.0))
        raise EngineUnavailableError(
            f"group {group[0].group_index} met a failing engine {_MAX_GROUP_REISSUES} times; "
            "read the engine logs"
        )

    async def _run_group_attempt(self, group: list[Sample]) -> GroupOutcome:
        if self._batchable(group):
            return await self._finish_group(group, await self._generate_group(group))
        tasks = [asyncio.create_task(self._generate(sample)) for sample in group]
        try:
            group[:] = await asyncio.gather(*tasks)
        except BaseException:
            # A failing sample cancels its siblings; the first error propagates as it is.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return await self._finish_group(group, group)

    async def _finish_group(self, group: list[Sample], generated: list[Sample]) -> GroupOutcome:
        group[:] = generated
        if any(sample.status == SampleStatus.ABORTED for sample in group):
            return GroupOutcome.ABORTED
        if self.stopping:
            return GroupOutcome.UNSCORED
        await self.score_groups([group])
        if self.group_filter is None or keep_group(self.group_filter, group):
            return GroupOutcome.KEPT
        return GroupOutcome.FILTERED

    def _batchable(self, group: list[Sample]) -> bool:
        """A fresh group with the default generate function goes out as one batched request:
        the engine admits its samples together (one prefill, no trickle of single requests).
        Behind a router, and for custom or resumed samples, each sample is its own request."""
        return (
            self.generate_fn is generate_sample
            and self.pool.router_url is None
            and all(s.response_length == 0 and s.status != SampleStatus.ABORTED for s in group)
        )

    async def _generate_group(self, group: list[Sample]) -> list[Sample]:
        async with self.slots:
            if self.stopping:  # the batch filled while this group waited for a slot
                for sample in group:
                    sample.status = SampleStatus.ABORTED
                return group
            params = [
                {
                    **self.base_params,
                    "sampling_seed": self.config.sampling_seed(s.index, s.response_length),
                }
                for s in group
            ]
            payload = {
                "input_ids": [s.tokens for s in group],
                "sampling_params": params,
                "return_logprob": True,
            }
            if self.config.return_routed_experts:
                payload["return_routed_experts"] = True
            responses = await self.pool.generate(payload)
        if not isinstance(responses, list) or len(responses) != len(group):
            raise ValueError(
                f"a batched /generate of {len(group)} prompts answered "
                f"{type(responses).__name__} of {len(responses) if isinstance(responses, list) else 1}"
            )
        return [append_response(s, r) for s, r in zip(group, responses, strict=True)]

    async def _generate(self, sample: Sample) -> Sample:
        if not needs_generation(sample):
            return sample  # finished in an earlier rollout, left over with its group
        remaining = self.config.rollout_max_response_len - sample.response_length
        if remaining <= 0:
            sample.status = SampleStatus.TRUNCATED
            return sample
        async with self.slots:
            if self.stopping:  # the batch filled while this sample waited for a slot
                sample.status = SampleStatus.ABORTED
                return sample
            params = {
                **self.base_params,
                "max_new_tokens": remaining,
                "sampling_seed": self.config.sampling_seed(sample.index, sample.response_length),
            }
            if self.generate_fn is generate_sample and self.config.return_routed_experts:
                return await generate_sample(self.pool, sample, params, return_routed_experts=True)
            return await self.generate_fn(self.pool, sample, params)

    async def _drain_leftovers(self, rollout_id: int) -> None:
        """Abort what is still generating and wait until every leftover request has returned."""
        self.stopping = True
        started = time.monotonic()
        while self.tasks:
            await self.pool.abort_all()
            done, _ = await asyncio.wait(self.tasks, timeout=_ABORT_POLL_S)
            for task in done:
                position, outcome = self.tasks.pop(task), task.result()
                if outcome is GroupOutcome.FILTERED:
                    self.counts["filtered_groups"] += 1
                    continue
                self.counts["aborted_groups"] += outcome is GroupOutcome.ABORTED
                self.leftover.append(position)
            if self.tasks and time.monotonic() - started > 10:
                logger.warning(
                    "rollout %d: still waiting for %d aborted groups after %.0f s",
                    rollout_id, len(self.tasks), time.monotonic() - started,
                )  # fmt: skip

    def _hand_back_leftovers(self, rollout_id: int) -> None:
        if not self.leftover:
            return
        groups = [self.groups[position] for position in sorted(self.leftover)]
        if self.config.partial_rollout:
            self.data_source.add_samples(groups)
            logger.info(
                "rollout %d: %d leftover groups go back to the data source", rollout_id, len(groups)
            )
        else:
            logger.info("rollout %d: dropping %d leftover groups", rollout_id, len(groups))

    async def _cancel(self) -> None:
        """On failure: stop every request of this rollout, leave no task behind."""
        self.stopping = True
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
            try:
                await self.pool.abort_all()
            except Exception:
                logger.exception("could not abort the engines' requests after a rollout failure")

    def _metrics(self, kept: list[list[Sample]], elapsed_s: float) -> dict[str, float]:
        samples = [sample for group in kept for sample in group]
        lengths = [sample.response_length for sample in samples]
        rewards = [sample.reward for sample in samples if sample.reward is not None]
        truncated = sum(sample.status == SampleStatus.TRUNCATED for sample in samples)
        metrics = {f"rollout/{name}": float(value) for name, value in self.counts.items()}
        metrics.update({
            "rollout/submitted_groups": float(len(self.groups)),
            "rollout/leftover_groups": float(len(self.leftover)),
            "rollout/truncated_ratio": truncated / len(samples),
            "rollout/response_len_mean": sum(lengths) / len(lengths),
            "rollout/response_len_max": float(max(lengths)),
            "rollout/generate_time_s": elapsed_s,
            "rollout/samples_per_s": len(samples) / max(elapsed_s, 1e-9),
        })  # fmt: skip
        if rewards:
            metrics["rollout/reward_mean"] = sum(rewards) / len(rewards)
            metrics["rollout/reward_min"] = float(min(rewards))
            metrics["rollout/reward_max"] = float(max(rewards))
        return metrics
