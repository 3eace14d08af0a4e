"""Generate (or continue) one sample with one /generate call, and fold the answer into it.

`generate_sample` is how the single-turn rollout makes a sample; a function given by
`--custom-generate-function-path` has the same signature and may call it, or `append_response`, for
the engine round trip. A sample whose
earlier generation was aborted continues from its tokens: the new response tokens, text and
log-probs are appended to the old ones.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from miles.backends.training_utils.batching.sample import Sample, SampleStatus
from miles.rollout.engine_pool import EnginePool

GenerateFunction = Callable[[EnginePool, Sample, dict[str, Any]], Awaitable[Sample]]
"""`async fn(pool, sample, sampling_params) -> Sample`; `sampling_params["max_new_tokens"]` is
already what is left of this sample's response budget."""

_FINISH_STATUS = {"length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


def finish_status(response: dict[str, Any]) -> SampleStatus:
    """How an SGLang /generate answer ended, as a sample status."""
    reason = (response.get("meta_info") or {}).get("finish_reason") or {}
    return _FINISH_STATUS.get(reason.get("type"), SampleStatus.COMPLETED)


def completion_of(response: dict[str, Any]) -> tuple[list[int], list[float]]:
    """The output ids of an SGLang /generate answer and the engine's log-prob of each.

    `meta_info.output_token_logprobs` is SGLang's list of `[logprob, token_id, text|None]`.
    """
    entries = (response.get("meta_info") or {}).get("output_token_logprobs")
    if entries is None:
        raise ValueError(
            "the engine's /generate answer has no meta_info.output_token_logprobs; send "
            '"return_logprob": true'
        )
    # Older SGLang answers carry no output_ids; the log-prob entries name the tokens too.
    output_ids = [int(t) for t in response.get("output_ids", [entry[1] for entry in entries])]
    if [int(entry[1]) for entry in entries] != output_ids:
        raise ValueError(
            f"the engine's output_token_logprobs ({len(entries)} entries) do not match its "
            f"output_ids ({len(output_ids)} tokens)"
        )
    return output_ids, [float(entry[0]) for entry in entries]


def needs_generation(sample: Sample) -> bool:
    """A fresh sample (no response yet) or one whose generation was aborted part-way."""
    return sample.status == SampleStatus.ABORTED or sample.response_length == 0


async def generate_sample(
    pool: EnginePool,
    sample: Sample,
    sampling_params: dict[str, Any],
    *,
    return_routed_experts: bool = False,
) -> Sample:
    """One /generate from `sample.tokens` (prompt plus any partial response); updates `sample`.
    `return_routed_experts`: keep the engine's MoE routing of the tokens (routing replay)."""
    payload = {
        "input_ids": sample.tokens,
        "sampling_params": sampling_params,
        "return_logprob": True,
    }
    if return_routed_experts:
        payload["return_routed_experts"] = True
    if sample.images:  # SGLang's field; the prompt's ids hold the processor's image tokens
        payload["image_data"] = sample.images
    response = await pool.generate(payload)
    return append_response(sample, response)


def append_response(sample: Sample, response: dict[str, Any]) -> Sample:
    """Append an SGLang /generate answer to `sample`: tokens, text, log-probs, status, version.

    `meta_info.output_token_logprobs` is SGLang's list of `[logprob, token_id, text|None]`.
    """
    try:
        output_ids, log_probs = completion_of(response)
    except ValueError as err:
        raise ValueError(f"sample {sample.index}: {err}") from None
    meta = response.get("meta_info") or {}
    if sample.rollout_log_probs is None and sample.response_length > 0:
        raise ValueError(
            f"sample {sample.index} has a {sample.response_length}-token response but no "
            "rollout_log_probs, so new log-probs cannot be aligned to it"
        )
    old_mask = sample.effective_loss_mask
    sample.tokens = [*sample.tokens, *output_ids]
    sample.rollout_log_probs = [*(sample.rollout_log_probs or []), *log_probs]
    sample.loss_mask = [*old_mask, *[1] * len(output_ids)]
    sample.response_length += len(output_ids)
    sample.response += response.get("text") or ""
    sample.status = finish_status(response)
    if meta.get("routed_experts") is not None:
        # Each answer covers every token read so far, prompt included: the latest supersedes.
        sample.routed_experts = meta["routed_experts"]
    version = meta.get("weight_version")
    if output_ids and version is not None:
        # A resumed sample may span weight updates: training sees the latest version, the
        # metadata keeps every version that contributed tokens, oldest first, and how many
        # response tokens each made (what --mask-offpolicy-in-partial-rollout reads).
        sample.metadata.setdefault("weight_versions", []).append(version)
        sample.metadata.setdefault("weight_version_tokens", []).append(len(output_ids))
        sample.weight_version = as_weight_version(version)
    sample.validate()
    return sample


def as_weight_version(version: Any) -> int | None:
    """SGLang reports versions as strings ("3"); a non-numeric one (SGLang's "default") is None."""
    try:
        return int(version)
    except (TypeError, ValueError):
        return None
