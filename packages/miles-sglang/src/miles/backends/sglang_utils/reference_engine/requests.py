"""Parsing of SGLang's /generate body (GenerateReqInput) into per-sequence work, and the
response format SGLang returns for it.

Every GenerateReqInput field is accepted: fields the reference engine cannot honour are fine at
their default value and a 400 naming the field otherwise (clients such as sglang-router send
several of them on every request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles.backends.sglang_utils.reference_engine.sampling import (
    InvalidRequestError,
    SamplingParams,
)

# GenerateReqInput fields handled here.
HANDLED = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "stream"}
# Fields that only shape logging, routing or tracing: any value is accepted.
PASS_THROUGH = {
    "model",
    "log_metrics",
    "routed_dp_rank",
    "data_parallel_rank",
    "disagg_prefill_dp_rank",
    "conversation_id",
    "priority",
    "extra_key",
    "routing_key",
    "no_logs",
    "custom_labels",
    "external_trace_header",
    "received_time",
    "background",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
    "lora_id",
    "modalities",
    "return_text_in_logprobs",
    "require_reasoning",
}
# Fields whose non-default values ask for something this engine does not do.
DEFAULTS_ONLY: dict[str, tuple[Any, ...]] = {
    "input_embeds": (None,),
    "image_data": (None, [], ""),
    "video_data": (None, [], ""),
    "audio_data": (None, [], ""),
    "use_audio_in_video": (False,),
    "logprob_start_len": (None, -1),
    "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None, []),
    "return_hidden_states": (False,),
    "return_routed_experts": (False,),
    "return_indexer_topk": (False,),
    "routed_experts_start_len": (0,),
    "session_params": (None,),
    "lora_path": (None,),
    "custom_logit_processor": (None,),
    "positional_embed_overrides": (None,),
    "return_bytes": (False,),
    "return_entropy": (False,),
    "need_wait_for_mm_inputs": (None, False),
    "num_items_assigned": (None,),
    "max_dynamic_patch": (None,),
    "min_dynamic_patch": (None,),
    "image_max_dynamic_patch": (None,),
    "video_max_dynamic_patch": (None,),
    "multi_item_delimiter_indices": (None,),
}


@dataclass
class SequenceSpec:
    """One sequence to generate, after batch and `n` expansion."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool


@dataclass
class ParsedGenerate:
    sequences: list[SequenceSpec]
    is_batch: bool
    stream: bool


def _check_fields(body: dict[str, Any]) -> None:
    for name, value in body.items():
        if name in HANDLED or name in PASS_THROUGH:
            continue
        if name in DEFAULTS_ONLY:
            if value not in DEFAULTS_ONLY[name]:
                raise InvalidRequestError(
                    f"{name}={value!r} is not supported by the reference engine; leave it at its "
                    f"default ({DEFAULTS_ONLY[name][0]!r}) or use an SGLang engine"
                )
            continue
        raise InvalidRequestError(
            f"unknown /generate field {name!r}; see SGLang's GenerateReqInput"
        )


def _as_list(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise InvalidRequestError(f"{name} has {len(value)} entries for {count} prompts")
        return value
    return [value] * count


def parse_generate(body: Any, tokenize) -> ParsedGenerate:
    """`tokenize(text) -> ids`. Raises InvalidRequestError for anything malformed."""
    if not isinstance(body, dict):
        raise InvalidRequestError(
            f"the /generate body must be a JSON object, got {type(body).__name__}"
        )
    _check_fields(body)
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise InvalidRequestError("give exactly one of 'text' or 'input_ids'")
    if text is not None:
        is_batch = isinstance(text, list)
        prompts = [tokenize(t) for t in (text if is_batch else [text])]
    else:
        if not isinstance(input_ids, list) or not input_ids:
            raise InvalidRequestError(
                "input_ids must be a non-empty list of token ids (or of lists)"
            )
        is_batch = isinstance(input_ids[0], list)
        prompts = input_ids if is_batch else [input_ids]
    for prompt in prompts:
        if not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt):
            raise InvalidRequestError(
                "each prompt must be a non-empty list of non-negative int token ids"
            )
    count = len(prompts)
    sampling = [
        SamplingParams.from_json(p)
        for p in _as_list(body.get("sampling_params"), count, "sampling_params")
    ]
    rids = _as_list(body.get("rid"), count, "rid")
    logprob = _as_list(body.get("return_logprob"), count, "return_logprob")
    n = sampling[0].n
    if any(p.n != n for p in sampling):
        raise InvalidRequestError("sampling_params.n must be the same for every prompt of a batch")
    sequences = []
    for i, (prompt, params) in enumerate(zip(prompts, sampling, strict=True)):
        for copy in range(n):
            rid = rids[i] if rids[i] is not None else None
            if rid is not None and n > 1:
                rid = f"{rid}-{copy}"
            spec = SequenceSpec(
                rid=rid or "",
                input_ids=list(prompt),
                params=params,
                return_logprob=bool(logprob[i]),
            )
            sequences.append(spec)
    return ParsedGenerate(
        sequences=sequences, is_batch=is_batch or n > 1, stream=bool(body.get("stream", False))
    )


def response_item(request, text: str, return_logprob: bool) -> dict[str, Any]:
    """SGLang's per-sequence /generate result."""
    meta: dict[str, Any] = {
        "id": request.rid,
        "finish_reason": request.finish_reason,
        "prompt_tokens": len(request.input_ids),
        "completion_tokens": len(request.output_ids),
        "cached_tokens": request.cached_tokens,
        "weight_version": request.weight_version,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, None]
            for lp, tok in zip(request.output_logprobs, request.output_ids, strict=True)
        ]
    return {"text": text, "output_ids": list(request.output_ids), "meta_info": meta}
