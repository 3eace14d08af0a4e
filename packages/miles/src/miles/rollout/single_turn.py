"""The built-in rollout, the default of --rollout-function-path: one /generate call per sample.

A fresh group goes out as one batched request when the engines are reached directly (not behind a
router): the engine admits its samples together, one prefill and no trickle of single requests.
Behind a router, and for samples resumed from an aborted request, each sample is its own request.
`--custom-generate-function-path` swaps in the user's per-sample function (`CustomSampleRollout`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles.backends.training_utils.batching.sample import Sample, SampleStatus
from miles.backends.training_utils.infra.import_path import load_function
from miles.rollout.context import RolloutContext
from miles.rollout.contract import Rollout
from miles.rollout.rollout_config import GENERATE_FLAG, RolloutConfig
from miles.rollout.sample_generation import GenerateFunction, append_response, generate_sample
from miles.rollout.sample_rollout import SampleRollout

if TYPE_CHECKING:
    from miles.rollout.data_source import DataSourceConfig

__all__ = ["CustomSampleRollout", "SingleTurnRollout"]


class SingleTurnRollout(SampleRollout):
    """One answer per sample from one /generate call (continued from its tokens if an earlier
    rollout aborted it part-way)."""

    continues_partial_requests = True
    returns_routed_experts = True

    @classmethod
    def from_config(cls, config: RolloutConfig) -> Rollout:
        """This rollout, or with --custom-generate-function-path the user's per-sample function
        (naming `generate_sample` itself is the built-in way, batched groups included)."""
        if config.custom_generate_function_path:
            generate_fn = load_function(config.custom_generate_function_path, GENERATE_FLAG)
            if generate_fn is not generate_sample:
                return CustomSampleRollout(generate_fn)
        return cls()

    def check(self, rollout: RolloutConfig, data: DataSourceConfig) -> None:
        refuse_multi_turn_flags(rollout)

    async def generate_group(self, ctx: RolloutContext, group: list[Sample]) -> list[Sample]:
        fresh = all(s.response_length == 0 and s.status != SampleStatus.ABORTED for s in group)
        if fresh and ctx.pool.router_url is None:
            return await self._generate_batch(ctx, group)
        return await super().generate_group(ctx, group)

    async def generate_sample(
        self, ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]
    ) -> Sample:
        return await generate_sample(
            ctx.pool, sample, sampling_params,
            return_routed_experts=ctx.rollout.return_routed_experts,
        )  # fmt: skip

    async def _generate_batch(self, ctx: RolloutContext, group: list[Sample]) -> list[Sample]:
        config = ctx.rollout
        async with ctx.requests.slot() as open_:
            if not open_:  # the batch filled while this group waited for a slot
                for sample in group:
                    sample.status = SampleStatus.ABORTED
                return group
            base_params = config.sampling_params()
            params = [
                {**base_params, "sampling_seed": config.sampling_seed(s.index, s.response_length)}
                for s in group
            ]
            payload = {
                "input_ids": [s.tokens for s in group],
                "sampling_params": params,
                "return_logprob": True,
            }
            if config.return_routed_experts:
                payload["return_routed_experts"] = True
            if any(s.images for s in group):  # one entry per request, as SGLang's batch form
                payload["image_data"] = [s.images for s in group]
            responses = await ctx.pool.generate(payload)
        if not isinstance(responses, list) or len(responses) != len(group):
            raise ValueError(
                f"a batched /generate of {len(group)} prompts answered "
                f"{type(responses).__name__} of {len(responses) if isinstance(responses, list) else 1}"
            )
        return [append_response(s, r) for s, r in zip(group, responses, strict=True)]


class CustomSampleRollout(SampleRollout):
    """The single-turn rollout with each sample made by a user's function
    (--custom-generate-function-path): `async fn(pool, sample, sampling_params) -> Sample`."""

    def __init__(self, generate_fn: GenerateFunction) -> None:
        self.generate_fn = generate_fn

    @classmethod
    def from_config(cls, config: RolloutConfig) -> CustomSampleRollout:
        if not config.custom_generate_function_path:
            raise ValueError(
                "miles.rollout.single_turn:CustomSampleRollout makes each sample with "
                "--custom-generate-function-path; pass it (or drop --rollout-function-path for "
                "the built-in single-turn rollout)"
            )
        return cls(load_function(config.custom_generate_function_path, GENERATE_FLAG))

    def check(self, rollout: RolloutConfig, data: DataSourceConfig) -> None:
        refuse_multi_turn_flags(rollout)

    async def generate_sample(
        self, ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]
    ) -> Sample:
        return await self.generate_fn(ctx.pool, sample, sampling_params)


def refuse_multi_turn_flags(rollout: RolloutConfig) -> None:
    """The multi-turn flags would do nothing in a single-turn rollout: say which rollout reads
    them."""
    for flag, value, user in (
        ("--tool-paths", rollout.tool_paths, "miles.rollout.tool_rollout:ToolRollout"),
        ("--agent-function-path", rollout.agent_function_path,
         "miles.rollout.agent_rollout:AgentRollout"),
    ):  # fmt: skip
        if value:
            raise ValueError(
                f"{flag} is used by a multi-turn rollout function, and the default one "
                f"generates single turns; pass --rollout-function-path {user}"
            )
