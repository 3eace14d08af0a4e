"""The built-in rollout loop: make `rollout_batch_size` groups with a rollout's `generate_group`,
score each group as soon as it is complete, keep the groups the dynamic filter accepts, and return
exactly `rollout_batch_size` of them.

With a filter, prompts are submitted in rounds of `over_sampling_batch_size` whenever the groups
kept plus those still generating could no longer fill the batch. Once the batch is full the
leftover requests are aborted; with `--partial-rollout` the unfinished groups (and finished
surplus ones) go back to the data source, to be continued by the next rollout.
"""

from __future__ import annotations

import asyncio
import copy
import enum
import logging
import time
from collections.abc import Awaitable, Callable

from miles.backends.training_utils.batching.sample import Sample, SampleStatus
from miles.rollout.context import GroupGenerator, RolloutContext, RolloutOutput
from miles.rollout.engine_pool import EngineLostError, EngineUnavailableError
from miles.rollout.filters import GroupFilter, keep_group, resolve_filter

__all__ = ["GroupOutcome", "group_runner", "run_groups"]

logger = logging.getLogger(__name__)

# While leftovers drain, abort again this often: a request still on the wire when the previous
# abort landed would otherwise run to its full length.
_ABORT_POLL_S = 0.5
# A group sent again this often has met more dead engines than a run survives: the engines'
# supervisor stops the run long before (--max-engine-restarts), except behind a router, where a
# request cannot tell which engine failed it.
_MAX_GROUP_REISSUES = 8


async def run_groups(
    ctx: RolloutContext, generate_group: GroupGenerator, *, rollout_id: int
) -> RolloutOutput:
    """Make rollout `rollout_id`: exactly `ctx.rollout.rollout_batch_size` scored, kept groups,
    each made by `generate_group` (a rollout's `Rollout.generate_group`).

    Groups come back in submission (prompt) order, not completion order, so that the training
    batch does not depend on which request happened to finish first.
    """
    return await _GroupLoop(ctx.with_fresh_requests(), generate_group).run(rollout_id)


def group_runner(
    ctx: RolloutContext, generate_group: GroupGenerator
) -> Callable[[list[Sample]], Awaitable[GroupOutcome]]:
    """Run one group at a time exactly as `run_groups` runs each of its groups: generate (sent
    again from its start when an engine is lost), score, filter. For rollouts that are not made
    one batch at a time (the fully-async buffer)."""
    return _GroupLoop(ctx.with_fresh_requests(), generate_group).run_group


class GroupOutcome(enum.Enum):
    """How one group's generation ended."""

    KEPT = "kept"
    FILTERED = "filtered"
    ABORTED = "aborted"  # some sample's generation was aborted
    UNSCORED = "unscored"  # finished after the batch was full: left over as it is


class _GroupLoop:
    """The state of one `run_groups` call: submitted groups, their tasks, the counters."""

    def __init__(self, ctx: RolloutContext, generate_group: GroupGenerator) -> None:
        self.ctx = ctx
        self.pool = ctx.pool
        self.data_source = ctx.data_source
        self.score_groups = ctx.score_groups
        self.config = ctx.rollout
        self.generate_group = generate_group
        self.group_filter: GroupFilter | None = None
        if self.config.dynamic_sampling_filter_path:
            self.group_filter = resolve_filter(self.config.dynamic_sampling_filter_path)
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
        generated = await self.generate_group(self.ctx, group)
        if len(generated) != len(group):
            raise ValueError(
                f"{_qualname(self.generate_group)} returned {len(generated)} samples for the "
                f"group of prompt {group[0].group_index}, which has {len(group)} "
                "(--n-samples-per-prompt); return every sample of the group, in order"
            )
        group[:] = generated
        if any(sample.status == SampleStatus.ABORTED for sample in group):
            return GroupOutcome.ABORTED
        if self.ctx.requests.closed:
            return GroupOutcome.UNSCORED
        await self.score_groups([group])
        if self.group_filter is None or keep_group(self.group_filter, group):
            return GroupOutcome.KEPT
        return GroupOutcome.FILTERED

    async def _drain_leftovers(self, rollout_id: int) -> None:
        """Abort what is still generating and wait until every leftover request has returned."""
        self.ctx.requests.close()
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
        self.ctx.requests.close()
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
            try:
                await self.pool.abort_all()
            except Exception:
                logger.exception("could not abort the engines' requests after a rollout failure")

    def _metrics(self, kept: list[list[Sample]], elapsed_s: float) -> dict[str, float]:
        """The loop's own counts and pace, and the reward range (the divergence guard reads it).
        The samples' statistics (mean reward, lengths, statuses) are computed once, from the
        groups any rollout returns, by `miles.rollout.train_data.rollout_metrics`."""
        samples = [sample for group in kept for sample in group]
        rewards = [sample.reward for sample in samples if sample.reward is not None]
        metrics = {f"rollout/{name}": float(value) for name, value in self.counts.items()}
        metrics.update({
            "rollout/submitted_groups": float(len(self.groups)),
            "rollout/leftover_groups": float(len(self.leftover)),
            "rollout/generate_time_s": elapsed_s,
            "rollout/samples_per_s": len(samples) / max(elapsed_s, 1e-9),
        })  # fmt: skip
        if rewards:
            metrics["rollout/reward_min"] = float(min(rewards))
            metrics["rollout/reward_max"] = float(max(rewards))
        return metrics


def _qualname(fn: GroupGenerator) -> str:
    """`Class.generate_group` of a bound method (what a user's error message names)."""
    return getattr(fn, "__qualname__", repr(fn))
