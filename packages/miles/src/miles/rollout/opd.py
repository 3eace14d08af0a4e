"""Teacher scoring for on-policy distillation: the teacher's log-prob of every response token.

Each sample's prompt + response ids go to a teacher engine as one /generate request that
generates nothing (`max_new_tokens: 0`) and returns the prompt log-probs from position
`prompt_length - 1` on (SGLang's `logprob_start_len`). The engine lists None for that first
position and then log p_teacher(ids[p] | ids[:p]) for every later p: exactly the response tokens.
The scores go onto `Sample.teacher_log_probs`; the train step forms the KL
(`training_utils.algorithms.teacher_kl`). With --opd-kl-mode topk the same request also asks for the
teacher's top tokens at each position (`top_logprobs_num`, SGLang's `input_top_logprobs`), which
go onto `Sample.teacher_top_ids` and `teacher_top_log_probs`. Samples are scored with the teacher's own distribution
(temperature 1), whatever the rollout's temperature.
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

from miles.backends.training_utils.batching.sample import Sample
from miles.rollout.engine_pool import EnginePool

_MAX_CONCURRENT_REQUESTS = 64
"""Scoring requests in flight at once per rollout: enough to fill the teacher's batches."""


def scoring_request(sample: Sample, top_k: int = 0) -> dict[str, Any]:
    """SGLang's /generate body scoring `sample`'s response tokens without generating; with
    `top_k`, also the teacher's `top_k` likeliest tokens at each response position."""
    if sample.prompt_length < 1:
        raise ValueError(
            f"sample {sample.index} has no prompt token: the teacher scores each response token "
            "given the tokens before it, so the first must be a prompt token"
        )
    request = {
        "input_ids": list(sample.tokens),
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": sample.prompt_length - 1,
    }
    if top_k:
        request["top_logprobs_num"] = top_k
    return request


def response_log_probs(sample: Sample, meta_info: dict[str, Any]) -> list[float]:
    """The teacher's log-prob of each response token, from an answer to `scoring_request`."""
    entries = meta_info.get("input_token_logprobs")
    if entries is None:
        raise ValueError(
            "the teacher engine answered without meta_info.input_token_logprobs; it must support "
            "SGLang's prompt log-probs (return_logprob with logprob_start_len)"
        )
    # Entry 0 is position prompt_length - 1, listed as None; then one entry per response token.
    scored = entries[1:]
    ids = [entry[1] for entry in scored]
    if ids != sample.response_tokens:
        raise ValueError(
            f"the teacher scored tokens {ids[:8]}... for sample {sample.index}, whose response is "
            f"{sample.response_tokens[:8]}... ({len(scored)} vs {sample.response_length} tokens); "
            "the engine must list the prompt from logprob_start_len on"
        )
    return [float(entry[0]) for entry in scored]


def response_top_tokens(
    sample: Sample, meta_info: dict[str, Any], top_k: int
) -> tuple[list[list[int]], list[list[float]]]:
    """The teacher's `top_k` likeliest tokens at each response position and their log-probs,
    likeliest first, from an answer to `scoring_request(sample, top_k)`."""
    entries = meta_info.get("input_top_logprobs")
    if entries is None:
        raise ValueError(
            "the teacher engine answered without meta_info.input_top_logprobs; it must support "
            "SGLang's top_logprobs_num for prompt positions (--opd-kl-mode topk)"
        )
    scored = entries[1:]  # entry 0 (position prompt_length - 1) is None, as for the tokens
    if len(scored) != sample.response_length or any(
        top is None or len(top) != top_k for top in scored
    ):
        widths = sorted({-1 if top is None else len(top) for top in scored})
        raise ValueError(
            f"the teacher listed {len(scored)} positions of {widths} top tokens for sample "
            f"{sample.index}, which has {sample.response_length} response tokens and asked for "
            f"{top_k} each (--opd-top-k must not exceed the teacher's vocabulary)"
        )
    ids = [[int(entry[1]) for entry in top] for top in scored]
    log_probs = [[float(entry[0]) for entry in top] for top in scored]
    return ids, log_probs


async def score_with_teacher(pool: EnginePool, groups: list[list[Sample]], top_k: int = 0) -> None:
    """Set `teacher_log_probs` on every sample of `groups` (one request per sample), and with
    `top_k` (--opd-kl-mode topk) `teacher_top_ids` and `teacher_top_log_probs` too."""
    limit = asyncio.Semaphore(_MAX_CONCURRENT_REQUESTS)

    async def score(sample: Sample) -> None:
        if sample.response_length == 0:
            sample.teacher_log_probs = []
            if top_k:
                sample.teacher_top_ids, sample.teacher_top_log_probs = [], []
            return
        async with limit:
            answer = await pool.generate(scoring_request(sample, top_k))
        sample.teacher_log_probs = response_log_probs(sample, answer["meta_info"])
        if top_k:
            sample.teacher_top_ids, sample.teacher_top_log_probs = response_top_tokens(
                sample, answer["meta_info"], top_k
            )

    await asyncio.gather(*(score(s) for group in groups for s in group))


def teacher_kl_metrics(groups: list[list[Sample]]) -> dict[str, float]:
    """`opd/teacher_kl`: mean per trainable token of log p_student - log p_teacher, with the
    engine's log-probs as the student's (present when the rollout requested them)."""
    kls = [
        student - teacher
        for group in groups
        for sample in group
        if sample.rollout_log_probs is not None and sample.teacher_log_probs is not None
        for student, teacher, mask in zip(
            sample.rollout_log_probs,
            sample.teacher_log_probs,
            sample.effective_loss_mask,
            strict=True,
        )
        if mask
    ]
    return {"opd/teacher_kl": statistics.fmean(kls)} if kls else {}
