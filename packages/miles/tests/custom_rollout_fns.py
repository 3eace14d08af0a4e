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
