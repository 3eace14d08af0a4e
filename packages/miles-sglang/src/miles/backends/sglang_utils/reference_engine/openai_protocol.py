"""OpenAI's chat-completions and completions bodies, with the field names and extensions SGLang's
OpenAI-compatible server uses (`chat_template_kwargs`, `input_ids`, `return_prompt_token_ids`,
`return_token_ids`, `top_k`, `min_p`, `ignore_eos`, `stop_token_ids`, `no_stop_trim`), validated
before anything is tokenized or queued; and the pieces of their answers.

What the reference engine cannot honour (penalties, logit bias, structured output, forced tool
choice, echo, suffix) is refused with a 400 naming the field unless it is at its default, and a
field neither API knows is refused the same way: a request never quietly means less than it says.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    model_validator,
)

from miles.backends.sglang_utils.chat_arguments import TEMPLATE_ARGUMENTS
from miles.backends.sglang_utils.reference_engine.errors import InvalidRequestError
from miles.backends.sglang_utils.reference_engine.request_models import Seed, TokenId
from miles.backends.sglang_utils.reference_engine.requests import MAX_TOP_LOGPROBS
from miles.backends.sglang_utils.reference_engine.sampling import SamplingParams

Number = StrictInt | StrictFloat
# Fields that only label, route or store a request elsewhere: any value is accepted.
PASS_THROUGH = {"user", "metadata", "store", "service_tier", "priority", "extra_key"}
# Fields this engine honours only at their default (OpenAI's or SGLang's).
DEFAULTS_ONLY: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "regex": (None,),
    "ebnf": (None,),
    "json_schema": (None,),
    "min_tokens": (0, None),
    "echo": (False, None),
    "suffix": (None, ""),
    "reasoning_effort": (None,),
    "return_hidden_states": (False,),
    "return_routed_experts": (False,),
    "separate_reasoning": (True,),
    "stream_reasoning": (True,),
    "continue_final_message": (False,),
    "skip_special_tokens": (True,),
    "lora_path": (None,),
    "session_params": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "audio": (None,),
    "web_search_options": (None,),
    "functions": (None,),
    "function_call": (None, "none", "auto"),
}


@dataclass(frozen=True)
class Server:
    """Who answers a body, named in the refusals of what it cannot honour."""

    name: str
    instead: str
    """What to do instead, after "leave it at its default": e.g. "use an SGLang engine"."""
    reads_images: bool = False
    """Whether messages may carry `image_url` parts (for a vision-language model to read)."""


REFERENCE_ENGINE = Server("the reference engine", "use an SGLang engine", reads_images=True)


def _server(info: ValidationInfo) -> Server:
    return (info.context or {}).get("server", REFERENCE_ENGINE)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _nulls_mean_defaults(cls, data: Any) -> Any:
        """OpenAI's clients send null for an option the caller passed as None: its default."""
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {k: v for k, v in data.items()
                    if not (v is None and k in fields and fields[k].default is not None)}  # fmt: skip
        return data

    @model_validator(mode="after")
    def _known_fields(self, info: ValidationInfo) -> _Body:
        server = _server(info)
        for name, value in (self.model_extra or {}).items():
            if name in PASS_THROUGH:
                continue
            if name not in DEFAULTS_ONLY:
                raise ValueError(f"unknown field {name!r}")
            if value not in DEFAULTS_ONLY[name]:
                raise ValueError(
                    f"{name}={value!r} is not supported by {server.name}; leave it at "
                    f"{DEFAULTS_ONLY[name][0]!r} or {server.instead}"
                )
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    continuous_usage_stats: Literal[False] = False  # usage is sent once, at the end


class _Sampling(_Body):
    """The sampling fields both APIs share."""

    model: StrictStr = "default"
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: StrictInt | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=128)] = 1
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=16)] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Seed | None = None
    ignore_eos: StrictBool = False
    no_stop_trim: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    return_token_ids: StrictBool = False
    rid: Annotated[StrictStr, Field(min_length=1)] | None = None
    """A request id for /abort_request; its sequences are rid-0, rid-1, ... when there are more."""

    @property
    def stops(self) -> list[str]:
        """`stop` as a list (OpenAI takes one string or several)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @model_validator(mode="after")
    def _stops(self) -> _Sampling:
        if any(stop == "" for stop in self.stops):
            raise ValueError("stop: an empty stop string would end every answer at once")
        return self

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else float(self.min_p),
            stop=self.stops,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            no_stop_trim=self.no_stop_trim,
            seed=self.seed,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# -- chat ---------------------------------------------------------------------------------------


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: StrictStr


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: StrictStr
    """A data: URL, raw base64 or a local file path on the engine's machine (`images.py`)."""
    detail: Literal["auto"] | None = None  # the model's processor decides the resolution


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr
    arguments: StrictStr | dict[str, Any]


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class Message(BaseModel):
    # Clients echo a previous answer's message back, with OpenAI's empty extras (refusal,
    # annotations, audio): those are accepted when empty.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None

    @model_validator(mode="after")
    def _shape(self, info: ValidationInfo) -> Message:
        for name, value in (self.model_extra or {}).items():
            if value not in (None, [], ""):
                raise ValueError(f"unknown message field {name!r}")
        if self.content is None and not self.tool_calls and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        server = _server(info)
        if self.image_urls and not server.reads_images:
            raise ValueError(
                f"image_url content parts are not read by {server.name}: send text content"
            )
        return self

    @property
    def image_urls(self) -> list[str]:
        """The message's images (`image_url` parts), in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: text content, tool-call arguments as objects
        (templates write them with `tojson`; a JSON string would be quoted twice). Content with
        images stays a list of parts, each image an `{"type": "image"}` part where a
        vision-language template places its image placeholder."""
        out: dict[str, Any] = {"role": self.role}
        if self.image_urls:
            out["content"] = [
                {"type": "text", "text": part.text}
                if isinstance(part, TextPart)
                else {"type": "image"}
                for part in self.content
            ]
        elif isinstance(self.content, list):
            out["content"] = "".join(part.text for part in self.content)
        else:
            out["content"] = self.content if self.content is not None else ""
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments_object(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        return out


def _arguments_object(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # the template writes what the client sent


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: dict[str, Any]


class ChatCompletionBody(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    input_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    return_prompt_token_ids: StrictBool = False

    @model_validator(mode="after")
    def _choices(self, info: ValidationInfo) -> ChatCompletionBody:
        server = _server(info)
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        shadowed = sorted(TEMPLATE_ARGUMENTS & set(self.chat_template_kwargs or {}))
        if shadowed:
            raise ValueError(
                f"chat_template_kwargs names {shadowed}: those are apply_chat_template's own "
                "arguments (the template is the model's), not template variables"
            )
        if any(tool.function.strict for tool in self.tools or []):
            raise ValueError(
                f"strict tool schemas need constrained decoding, which {server.name} does "
                f"not have; leave strict unset or {server.instead}"
            )
        if not self.parallel_tool_calls:
            raise ValueError(
                "parallel_tool_calls=false (at most one call) needs constrained decoding, which "
                f"{server.name} does not have; leave it true or {server.instead}"
            )
        if self.tool_choice is not None and not isinstance(self.tool_choice, str):
            raise ValueError(
                "a named tool_choice forces a call, which needs constrained decoding: "
                f"{server.name} has none; send 'auto' or {server.instead}"
            )
        if self.tool_choice == "required":
            raise ValueError(
                f"tool_choice='required' needs constrained decoding, which {server.name} "
                f"does not have; send 'auto' or {server.instead}"
            )
        return self

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def tool_names(self) -> set[str]:
        return {tool.function.name for tool in self.tools or []}

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# -- completions --------------------------------------------------------------------------------

TokenPrompt = Annotated[list[TokenId], Field(min_length=1)]


class CompletionBody(_Sampling):
    prompt: (
        StrictStr
        | Annotated[list[StrictStr], Field(min_length=1)]
        | TokenPrompt
        | Annotated[list[TokenPrompt], Field(min_length=1)]
    )
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = 16
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    best_of: StrictInt | None = None

    @model_validator(mode="after")
    def _best_of(self) -> CompletionBody:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of={self.best_of} (ranking {self.best_of} samples to return {self.n}) is "
                "not supported by the reference engine; leave it unset"
            )
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], list):
            return list(prompt)
        if prompt and isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


def validate(model: type[BaseModel], body: Any, server: Server = REFERENCE_ENGINE) -> Any:
    """`body` as `model`, or an InvalidRequestError naming the first bad field and its value
    (what `server` cannot honour is refused in its name)."""
    if not isinstance(body, dict):
        raise InvalidRequestError(f"the body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body, context={"server": server})
    except ValueError as err:  # pydantic's ValidationError is a ValueError
        errors = getattr(err, "errors", lambda: [])()
        if not errors:
            raise InvalidRequestError(str(err)) from None
        first = errors[0]
        where = ".".join(str(part) for part in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        shown = f" (got {first['input']!r})" if where and "input" in first else ""
        raise InvalidRequestError(
            f"{where + ': ' if where else ''}{message}{shown}"[:2000], param=where or None
        ) from None


# -- answers ------------------------------------------------------------------------------------


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def finish_reason(request: Any, has_tool_calls: bool) -> str:
    """OpenAI's finish_reason from the engine's: stop, length, tool_calls, or abort."""
    kind = (request.finish_reason or {}).get("type", "abort")
    if has_tool_calls and kind == "stop":
        return "tool_calls"
    return kind if kind in ("stop", "length") else "abort"


def matched_stop(request: Any) -> int | str | None:
    return (request.finish_reason or {}).get("matched")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
