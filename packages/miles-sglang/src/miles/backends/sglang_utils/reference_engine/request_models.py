"""The reference engine's request bodies as pydantic models: types and ranges are checked here,
before anything is queued, so a malformed request is a 400 naming its field and never reaches
the batched decode step that other requests share.

`validate_body(Model, body)` turns pydantic's report into one `InvalidRequestError` whose
`param` is the field's dotted path (`sampling_params.top_k`, `input_ids[1]`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from miles.backends.sglang_utils.reference_engine.errors import InvalidRequestError

TokenId = Annotated[StrictInt, Field(ge=0)]


def _json_number(value: Any) -> Any:
    # pydantic's float would also take "0.5" and True; a JSON number is neither.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"Input should be a number, not {type(value).__name__}")
    return value


# JSON numbers: an int or a float, never a numeric string or a bool, never NaN or infinity.
Number = Annotated[float, BeforeValidator(_json_number), Field(allow_inf_nan=False)]
Seed = Annotated[StrictInt, Field(ge=0, lt=2**63)]
# The most this engine generates for one sequence: far beyond any context, far below overflow.
MAX_NEW_TOKENS = 1 << 24


class SamplingParamsBody(BaseModel):
    """SGLang's sampling_params fields that the reference engine honours."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: Annotated[StrictInt, Field(ge=0, le=MAX_NEW_TOKENS)] = 128
    temperature: Annotated[Number, Field(ge=0)] = 1.0
    top_p: Annotated[Number, Field(gt=0, le=1)] = 1.0
    top_k: StrictInt = -1
    min_p: Annotated[Number, Field(ge=0, le=1)] = 0.0
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool = False
    no_stop_trim: StrictBool = False
    n: Annotated[StrictInt, Field(ge=1, le=1024)] = 1
    seed: Seed | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k_off_or_positive(cls, top_k: int) -> int:
        if top_k != -1 and top_k < 1:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return top_k


class ControlBody(BaseModel):
    """A control route's body: SGLang clients send fields this engine has no use for (e.g.
    `flush_cache`, `abort_all_requests`), so unknown fields are ignored, known ones typed."""

    model_config = ConfigDict(extra="ignore")


class StartProfileBody(ControlBody):
    """SGLang's /start_profile fields that the reference engine honours; it profiles from start
    to stop, so the step-counted ones are refused."""

    output_dir: StrictStr | None = None
    activities: list[StrictStr] = ["CPU", "GPU"]
    with_stack: StrictBool = False
    record_shapes: StrictBool = False
    start_step: None = None
    num_steps: None = None


class PauseBody(ControlBody):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class AbortBody(ControlBody):
    rid: StrictStr = ""
    abort_all: StrictBool = False


class DiskUpdateBody(ControlBody):
    model_path: Annotated[StrictStr, Field(min_length=1)]
    weight_version: StrictStr | None = None


class TensorUpdateBody(ControlBody):
    serialized_named_tensors: Annotated[list[StrictStr], Field(min_length=1)]
    load_format: StrictStr | None = None
    weight_version: StrictStr | None = None


class InitGroupBody(ControlBody):
    master_address: Annotated[StrictStr, Field(min_length=1)]
    master_port: Annotated[StrictInt, Field(ge=1, le=65535)]
    # Rank 0 hosts the rendezvous store: that is the trainer, never an engine (an engine would
    # bind a port on every interface for whoever connects first).
    rank_offset: Annotated[StrictInt, Field(ge=1)]
    world_size: Annotated[StrictInt, Field(ge=2)]
    group_name: Annotated[StrictStr, Field(min_length=1)]
    backend: Literal["gloo", "nccl", "hccl"]


class DistributedUpdateBody(ControlBody):
    names: list[StrictStr]
    dtypes: list[StrictStr]
    shapes: list[list[Annotated[StrictInt, Field(ge=0)]]]
    group_name: StrictStr
    weight_version: StrictStr | None = None
    load_format: Literal["flattened_bucket"] | None = None


class GroupBody(ControlBody):
    group_name: StrictStr


class MemoryBody(ControlBody):
    tags: list[Literal["weights", "kv_cache"]] | None = None


class WeightVersionBody(ControlBody):
    """SGLang's UpdateWeightVersionReqInput."""

    new_version: Annotated[StrictStr, Field(min_length=1)]
    abort_all_requests: StrictBool = False


class LoadLoraBody(ControlBody):
    """SGLang's LoadLoRAAdapterReqInput (its internal `lora_id` is ignored)."""

    lora_name: Annotated[StrictStr, Field(min_length=1)]
    lora_path: Annotated[StrictStr, Field(min_length=1)]
    pinned: StrictBool = False


class UnloadLoraBody(ControlBody):
    """SGLang's UnLoadLoRAAdapterReqInput."""

    lora_name: Annotated[StrictStr, Field(min_length=1)]


M = TypeVar("M", bound=BaseModel)


def validate_body(model: type[M], body: Any, *, prefix: str = "") -> M:
    """`body` as `model`, or InvalidRequestError naming the first wrong field and its value."""
    if not isinstance(body, dict):
        raise InvalidRequestError(
            f"the {prefix or 'request'} body must be a JSON object, got {type(body).__name__}",
            param=prefix or None,
        )
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise _invalid(err, prefix) from None


def _invalid(err: ValidationError, prefix: str) -> InvalidRequestError:
    errors = err.errors(include_url=False)
    first = errors[0]
    # The field, then list positions; a union's branch labels ("str", "list[str]") are
    # pydantic's, not the client's.
    field, *rest = first["loc"]
    param = f"{prefix}.{field}" if prefix else str(field)
    param += "".join(f"[{part}]" for part in rest if isinstance(part, int))
    message = first["msg"].removeprefix("Value error, ")
    got = f" (got {_short(first.get('input'))})" if first["type"] != "missing" else ""
    # A union's branches fail together on one field: they count as one problem.
    others = {e["loc"][0] for e in errors} - {field}
    more = f"; also wrong: {', '.join(map(str, sorted(others, key=str)))}" if others else ""
    return InvalidRequestError(f"{param}: {message}{got}{more}", param=param)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
