"""Custom generate and filter functions that the rollout tests load by import path."""

from __future__ import annotations

from miles.backends.training_utils.batching.sample import Sample
from miles.rollout.sample_generation import generate_sample

NOT_A_FUNCTION = 42


async def paced_generate(pool, sample: Sample, sampling_params: dict) -> Sample:
    """Samples marked `metadata["slow"]` run their whole budget; the others stop after 8 tokens."""
    if sample.metadata.get("slow"):
        params = {**sampling_params, "ignore_eos": True}
    else:
        params = {**sampling_params, "max_new_tokens": min(8, sampling_params["max_new_tokens"])}
    return await generate_sample(pool, sample, params)


async def canned_generate(pool, sample: Sample, sampling_params: dict) -> Sample:
    """Answers without an engine: a fixed 3-token response that records the params it got."""
    sample.tokens = [*sample.tokens, 65, 66, 67]
    sample.response, sample.response_length = "ABC", 3
    sample.rollout_log_probs, sample.loss_mask = [-1.0, -1.0, -1.0], [1, 1, 1]
    sample.metadata["sampling_params"] = dict(sampling_params)
    return sample


def keep_odd_groups(group: list[Sample]) -> bool:
    return group[0].group_index % 2 == 1


def says_maybe(group: list[Sample]) -> str:
    return "maybe"


async def whole_rollout(rollout_id, *, pool, data_source, score_groups, config):
    """A rollout function of the earlier signature: a whole rollout of one unanswered group."""
    del rollout_id, pool, score_groups, config
    return data_source.get_samples(1)


def sync_whole_rollout(rollout_id, *, pool, data_source, score_groups, config):
    """The earlier signature, synchronous, answering a RolloutOutput with a metric."""
    from miles.rollout.context import RolloutOutput

    return RolloutOutput(groups=data_source.get_samples(1), metrics={"mine/rollout": rollout_id})


def returns_a_dict(rollout_id, **kwargs):
    return {"groups": []}


def legacy_with_an_attribute(rollout_id, **kwargs):
    return []


legacy_with_an_attribute.sample_generator = lambda config: None


class Tagged:
    """A class that is not a miles Rollout."""


def _tagged_rollout_class():
    from miles.rollout.single_turn import SingleTurnRollout

    class TaggedRollout(SingleTurnRollout):
        """The built-in rollout, each sample tagged with the rollout settings' temperature."""

        async def generate_group(self, ctx, group):
            group = await super().generate_group(ctx, group)
            for sample in group:
                sample.metadata["made_at_temperature"] = ctx.rollout.rollout_temperature
            return group

    return TaggedRollout


TaggedRollout = _tagged_rollout_class()


def _short_rollout_class():
    from miles.rollout.contract import Rollout

    class DropsOne(Rollout):
        """A broken rollout: it loses a sample of every group."""

        async def generate_group(self, ctx, group):
            return group[:-1]

    return DropsOne


DropsOne = _short_rollout_class()
