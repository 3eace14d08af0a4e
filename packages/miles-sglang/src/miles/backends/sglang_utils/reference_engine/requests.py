"""Parsing of SGLang's /generate body (GenerateReqInput) into per-sequence work, and the
response format SGLang returns for it.

Every GenerateReqInput field is accepted: fields the reference engine cannot honour are fine at
their default value and a 400 naming the field otherwise (clients such as sglang-router send
several of them on every request). Types are checked (`GenerateBody`, `SamplingParamsBody`)
before anything is tokenized or queued. `image_data` is read by the engine's `ImageReader` (a
vision-language model's processor); without one, images are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from miles.backends.sglang_utils.reference_engine.errors import InvalidRequestError
from miles.backends.sglang_utils.reference_engine.request_models import TokenId, validate_body
from miles.backends.sglang_utils.reference_engine.routed_experts import encode_routed_experts
from miles.backends.sglang_utils.reference_engine.sampling import SamplingParams
from miles.backends.sglang_utils.reference_engine.vision_inputs import PromptImages, no_vision_tower

ImageReader = Callable[[str | list[int], list[str], str], tuple[list[int], PromptImages | None]]
"""`read(prompt, image_data, param)`: a prompt (text with one placeholder per image, or expanded
ids) and its image_data strings -> its token ids and images; `param` names the images in errors."""

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
    "require_reasoning",
}
# Fields whose non-default values ask for something this engine does not do.
DEFAULTS_ONLY: dict[str, tuple[Any, ...]] = {
    "input_embeds": (None,),
    "video_data": (None, [], ""),
    "audio_data": (None, [], ""),
    "use_audio_in_video": (False,),
    "return_hidden_states": (False,),
    "return_indexer_topk": (False,),
    "routed_experts_start_len": (0,),
    "session_params": (None,),
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
    top_logprobs_num: int = 0
    logprob_start_len: int | None = None
    """The first prompt position whose log-prob is listed; None for none (SGLang's -1)."""
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    lora_path: str | None = None
    """The loaded LoRA adapter to run with, by name (SGLang's `lora_path`); None: the base model."""
    images: PromptImages | None = None
    """The prompt's images (a vision-language model's); None for a text prompt."""


@dataclass
class ParsedGenerate:
    sequences: list[SequenceSpec]
    is_batch: bool
    stream: bool


def _check_fields(extra: dict[str, Any]) -> None:
    """The fields beyond GenerateBody's: pass-through ones, or others at their defaults."""
    for name, value in extra.items():
        if name in PASS_THROUGH:
            continue
        if name in DEFAULTS_ONLY:
            if value not in DEFAULTS_ONLY[name]:
                raise InvalidRequestError(
                    f"{name}={value!r} is not supported by the reference engine; leave it at its "
                    f"default ({DEFAULTS_ONLY[name][0]!r}) or use an SGLang engine",
                    param=name,
                )
            continue
        raise InvalidRequestError(
            f"unknown /generate field {name!r}; see SGLang's GenerateReqInput", param=name
        )


def _as_list(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise InvalidRequestError(
                f"{name} has {len(value)} entries for {count} prompts", param=name
            )
        return value
    return [value] * count


# How many of the likeliest tokens a response may list per position (OpenAI allows up to 20).
MAX_TOP_LOGPROBS = 20
TopLogprobsNum = Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)]


class GenerateBody(BaseModel):
    """The types of the GenerateReqInput fields handled here (the rest: `_check_fields`)."""

    model_config = ConfigDict(extra="allow")

    text: StrictStr | Annotated[list[StrictStr], Field(min_length=1)] | None = None
    input_ids: (
        Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
        | None
    ) = None
    sampling_params: Any = None  # one dict, or one per prompt: SamplingParams.from_json
    rid: StrictStr | list[StrictStr | None] | None = None
    return_logprob: StrictBool | list[StrictBool] | None = None
    top_logprobs_num: TopLogprobsNum | list[TopLogprobsNum] | None = None
    logprob_start_len: StrictInt | list[StrictInt] | None = None
    # A list for every prompt, or (a batch) one list per prompt; not a bare id (SGLang's
    # request contract, api/v1 TokenIdsOrList, refuses one).
    token_ids_logprob: list[TokenId] | list[list[TokenId]] | None = None
    return_text_in_logprobs: StrictBool = False
    return_routed_experts: StrictBool | list[StrictBool] = False
    # A loaded adapter's name for every prompt, or one per prompt of a batch (None: base model).
    lora_path: StrictStr | list[StrictStr | None] | None = None
    # SGLang's forms: one image, or a list of them, for a single prompt; for a batch, one image for
    # every prompt or one entry (an image, a list, or none) per prompt. Each image is a data: URL,
    # raw base64 or a local file path (`images.load_image`).
    image_data: StrictStr | list[StrictStr | list[StrictStr] | None] | None = None
    stream: StrictBool = False


@dataclass(frozen=True)
class GenerateLimits:
    """What one /generate may ask for, checked before any tokenizing or queueing."""

    max_text_chars: int
    """Characters of one text prompt (a token is at least one character of text)."""
    max_sequences: int
    """Sequences of one request: prompts x sampling_params.n."""


def parse_generate(
    body: Any,
    tokenize: Callable[[str], list[int]],
    limits: GenerateLimits,
    read_images: ImageReader | None = None,
) -> ParsedGenerate:
    """`tokenize(text) -> ids`; `read_images`: a vision-language model's prompt reader, which
    every prompt goes through (None: a text model, which refuses images). Raises
    InvalidRequestError for anything malformed or over a limit, naming the field."""
    parsed = validate_body(GenerateBody, body, prefix="")
    _check_fields(parsed.model_extra or {})
    text, input_ids = parsed.text, parsed.input_ids
    if (text is None) == (input_ids is None):
        raise InvalidRequestError("give exactly one of 'text' or 'input_ids'", param="text")
    count = len(text if isinstance(text, list) else input_ids if _nested(input_ids) else [0])
    raw_sampling = _as_list(parsed.sampling_params, count, "sampling_params")
    sampling = [
        SamplingParams.from_json(p, "sampling_params" + (f"[{i}]" if count > 1 else ""))
        for i, p in enumerate(raw_sampling)
    ]
    n = sampling[0].n
    if any(p.n != n for p in sampling):
        raise InvalidRequestError(
            "sampling_params.n must be the same for every prompt of a batch",
            param="sampling_params",
        )
    if count * n > limits.max_sequences:
        raise InvalidRequestError(
            f"{count} prompt(s) x n={n} is {count * n} sequences, over this engine's "
            f"{limits.max_sequences} per request (--max-queued-requests); split the request",
            param="sampling_params.n" if n > 1 else "input_ids",
        )
    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        for i, t in enumerate(texts):
            if len(t) > limits.max_text_chars:
                raise InvalidRequestError(
                    f"text{f'[{i}]' if is_batch else ''} has {len(t)} characters, more than the "
                    f"{limits.max_text_chars} that can fit the context length",
                    param="text",
                )
        sources: list[str] | list[list[int]] = texts
    else:
        is_batch = _nested(input_ids)
        sources = input_ids if is_batch else [input_ids]
    image_data = _images_per_prompt(parsed.image_data, count, is_batch)
    prompts, images = _read_prompts(sources, image_data, tokenize, read_images, is_batch)
    if text is not None and not all(prompts):
        raise InvalidRequestError("a text prompt tokenizes to no tokens", param="text")
    rids = _as_list(parsed.rid, count, "rid")
    logprob = _as_list(parsed.return_logprob, count, "return_logprob")
    top = _as_list(parsed.top_logprobs_num, count, "top_logprobs_num")
    starts = _as_list(parsed.logprob_start_len, count, "logprob_start_len")
    token_ids = _token_ids_per_prompt(parsed.token_ids_logprob, count, is_batch)
    routed = _as_list(parsed.return_routed_experts, count, "return_routed_experts")
    adapters = _as_list(parsed.lora_path, count, "lora_path")
    sequences = []
    for i, (prompt, params) in enumerate(zip(prompts, sampling, strict=True)):
        # As in SGLang, the log-prob fields count only with return_logprob.
        wanted = bool(logprob[i])
        listed = isinstance(parsed.logprob_start_len, list)
        param = f"logprob_start_len[{i}]" if listed else "logprob_start_len"
        start = _logprob_start(starts[i], len(prompt), param) if wanted else None
        for copy in range(n):
            rid = rids[i] if rids[i] is not None else None
            if rid is not None and n > 1:
                rid = f"{rid}-{copy}"
            spec = SequenceSpec(
                rid=rid or "",
                input_ids=list(prompt),
                params=params,
                return_logprob=wanted,
                top_logprobs_num=int(top[i] or 0) if wanted else 0,
                logprob_start_len=start,
                token_ids_logprob=token_ids[i] if wanted else None,
                return_text_in_logprobs=parsed.return_text_in_logprobs,
                return_routed_experts=bool(routed[i]),
                lora_path=adapters[i],
                images=images[i],
            )
            sequences.append(spec)
    return ParsedGenerate(sequences=sequences, is_batch=is_batch or n > 1, stream=parsed.stream)


def _images_per_prompt(value: Any, count: int, is_batch: bool) -> list[list[str]]:
    """SGLang's `image_data` as each prompt's list of images ([] for none)."""
    if value is None or value == "":
        return [[] for _ in range(count)]
    if isinstance(value, str):  # one image: the prompt's, or every prompt's in a batch
        return [[value] for _ in range(count)]
    if not is_batch:
        if any(not isinstance(item, str) for item in value):
            raise InvalidRequestError(
                "image_data for a single prompt is an image or a flat list of images; a list of "
                "lists is one entry per prompt of a batch",
                param="image_data",
            )
        return [list(value)]
    if value == []:
        return [[] for _ in range(count)]
    per_prompt = _as_list(value, count, "image_data")
    return [[] if v is None else [v] if isinstance(v, str) else list(v) for v in per_prompt]


def _read_prompts(
    sources: list[str] | list[list[int]],
    image_data: list[list[str]],
    tokenize: Callable[[str], list[int]],
    read_images: ImageReader | None,
    is_batch: bool,
) -> tuple[list[list[int]], list[PromptImages | None]]:
    """Each prompt's token ids and images: text is tokenized, or with a vision-language model
    expanded by its processor with the images."""
    if read_images is None:
        given = sum(map(len, image_data))
        if given:
            raise no_vision_tower(given, "image_data")
        ids = [tokenize(s) if isinstance(s, str) else s for s in sources]
        return ids, [None] * len(sources)
    read = [
        read_images(source, values, f"image_data[{i}]" if is_batch else "image_data")
        for i, (source, values) in enumerate(zip(sources, image_data, strict=True))
    ]
    return [ids for ids, _ in read], [images for _, images in read]


def _logprob_start(value: int | None, prompt_len: int, param: str) -> int | None:
    """SGLang's `logprob_start_len`: -1 (the default) lists no prompt position (SGLang 0.5.23
    moves it past the prompt; older releases listed the last one); past the prompt's length is
    refused (SGLang aborts it with a 400 too)."""
    if value is None or value == -1:
        return None
    if not 0 <= value <= prompt_len:
        raise InvalidRequestError(
            f"{param}={value} is out of range for a prompt of {prompt_len} tokens: it must be "
            f"-1 (no prompt log-probs) or in [0, {prompt_len}]",
            param=param,
        )
    return value


def _token_ids_per_prompt(value: Any, count: int, is_batch: bool) -> list[list[int] | None]:
    """SGLang's `token_ids_logprob` per prompt: one list for every prompt, or one per prompt in
    a batch; None and [] ask for nothing."""
    if not value:
        return [None] * count
    if not isinstance(value[0], list):
        return [list(value)] * count
    if not is_batch:
        raise InvalidRequestError(
            "token_ids_logprob must be a flat list of token ids for a single prompt",
            param="token_ids_logprob",
        )
    return [ids or None for ids in _as_list(value, count, "token_ids_logprob")]


def _nested(input_ids: Any) -> bool:
    return isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)


def response_item(
    request, text: str, spec: SequenceSpec, token_texts: Callable[[list[int]], list[str]]
) -> dict[str, Any]:
    """SGLang's per-sequence /generate result. `token_texts(ids)`: each token's text, for
    return_text_in_logprobs."""
    count = len(request.output_ids)  # the engine may be appending: read up to this token
    meta: dict[str, Any] = {
        "id": request.rid,
        "finish_reason": request.finish_reason,
        "prompt_tokens": len(request.input_ids),
        "completion_tokens": count,
        "cached_tokens": request.cached_tokens,
        "weight_version": request.weight_version,
    }
    if spec.return_logprob:
        meta.update(
            _logprob_fields(request, count, token_texts if spec.return_text_in_logprobs else None)
        )
    if spec.return_routed_experts and request.routed_experts:
        meta["routed_experts"] = encode_routed_experts(request.routed_experts)
    return {"text": text, "output_ids": list(request.output_ids[:count]), "meta_info": meta}


def _logprob_fields(
    request, count: int, texts: Callable[[list[int]], list[str]] | None
) -> dict[str, Any]:
    """meta_info's log-prob fields as SGLang 0.5.23's tokenizer manager assembles them: lists of
    [logprob, token_id, text or None]; a position with no log-probs (the first listed prompt
    position) is None in the top / asked-token lists."""

    def listed(logprobs: list, ids: list[int]) -> list[list[Any]]:
        names = texts(ids) if texts is not None else [None] * len(ids)
        return [[lp, tok, name] for lp, tok, name in zip(logprobs, ids, names, strict=True)]

    def tops(step: list[tuple[float, int]] | None) -> list[list[Any]] | None:
        return None if step is None else listed([lp for lp, _ in step], [tok for _, tok in step])

    def asked(step: list[float] | None) -> list[list[Any]] | None:
        return None if step is None else listed(step, request.token_ids_logprob)

    prompt = request.prompt_logprobs
    # SGLang lists max(1, count) output entries of top / asked-token log-probs: a request that
    # generates nothing has one, the distribution after the prompt.
    shown = max(count, 1)
    fields: dict[str, Any] = {
        "input_token_logprobs": (
            listed(prompt.token, request.input_ids[prompt.start :]) if prompt else []
        ),
        "output_token_logprobs": listed(
            request.output_logprobs[:count], request.output_ids[:count]
        ),
        "output_token_logprobs_length": count,
    }
    if request.top_logprobs_num:
        fields["input_top_logprobs"] = [tops(step) for step in prompt.top] if prompt else []
        fields["output_top_logprobs"] = [tops(s) for s in request.output_top_logprobs[:shown]]
    if request.token_ids_logprob:
        fields["input_token_ids_logprobs"] = (
            [asked(step) for step in prompt.token_ids] if prompt else []
        )
        fields["output_token_ids_logprobs"] = [
            asked(step) for step in request.output_token_ids_logprobs[:shown]
        ]
    return fields
