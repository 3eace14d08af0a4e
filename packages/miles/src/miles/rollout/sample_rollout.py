"""`SampleRollout`: a rollout whose samples are each made on their own (one exchange per sample),
the base of the single-turn, tool and agent rollouts. A subclass writes `generate_sample`.

For each sample of a group it does what every such rollout needs: skip a sample finished in an
earlier rollout, truncate one with no response budget left, hold a request slot (so a rollout that
already has its batch sends nothing more), and give the sample its sampling parameters: what is
left of its token budget and a seed fixed by the run's seed, the sample and how far it got.
"""

from __future__ import annotations

import abc
import asyncio
from typing import Any

from miles.backends.training_utils.batching.sample import Sample, SampleStatus
from miles.rollout.context import RolloutContext
from miles.rollout.contract import Rollout
from miles.rollout.sample_generation import needs_generation

__all__ = ["SampleRollout"]


class SampleRollout(Rollout):
    """A rollout that makes each sample of a group on its own, concurrently."""

    @abc.abstractmethod
    async def generate_sample(
        self, ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]
    ) -> Sample:
        """Make (or continue) one sample and return it. `sampling_params` are SGLang's, with
        `max_new_tokens` already what is left of the sample's response budget and
        `sampling_seed` set."""

    async def generate_group(self, ctx: RolloutContext, group: list[Sample]) -> list[Sample]:
        tasks = [asyncio.create_task(self._generate(ctx, sample)) for sample in group]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            # A failing sample cancels its siblings; the first error propagates as it is.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _generate(self, ctx: RolloutContext, sample: Sample) -> Sample:
        if not needs_generation(sample):
            return sample  # finished in an earlier rollout, left over with its group
        config = ctx.rollout
        remaining = config.rollout_max_response_len - sample.response_length
        if remaining <= 0:
            sample.status = SampleStatus.TRUNCATED
            return sample
        async with ctx.requests.slot() as open_:
            if not open_:  # the batch filled while this sample waited for a slot
                sample.status = SampleStatus.ABORTED
                return sample
            params = {
                **config.sampling_params(),
                "max_new_tokens": remaining,
                "sampling_seed": config.sampling_seed(sample.index, sample.response_length),
            }
            return await self.generate_sample(ctx, sample, params)
