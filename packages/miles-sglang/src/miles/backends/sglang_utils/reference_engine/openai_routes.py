"""OpenAI-compatible routes of the reference engine: `POST /v1/chat/completions`,
`POST /v1/completions` and `GET /v1/models`, answered as SGLang's OpenAI-compatible server answers
them, streamed as server-sent events when asked.

Chat prompts are rendered with the checkpoint's chat template (tools and `chat_template_kwargs`
passed to it) and tokenized without extra special tokens, as the data source renders prompts. Tool
calls in the output become `message.tool_calls` (`tool_calls.py`). `return_prompt_token_ids` and
`return_token_ids` give the exact ids the engine read and wrote, which is what an RL trajectory is
built from. The `n` choices of a seeded request use seeds seed, seed + 1, ...: the same seed for
all would give n copies of one sample. With LoRA serving, `model: "<base>:<adapter>"` runs a loaded
adapter, as in SGLang (SGLang's explicit `lora_path` field is not taken here).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from PIL import Image

from miles.backends.sglang_utils.reference_engine.errors import InvalidRequestError
from miles.backends.sglang_utils.reference_engine.images import load_image
from miles.backends.sglang_utils.reference_engine.openai_protocol import (
    ChatCompletionBody,
    CompletionBody,
    ImagePart,
    completion_id,
    finish_reason,
    matched_stop,
    now,
    usage,
    validate,
)
from miles.backends.sglang_utils.reference_engine.requests import ParsedGenerate, SequenceSpec
from miles.backends.sglang_utils.reference_engine.sampling import SamplingParams
from miles.backends.sglang_utils.reference_engine.scheduler import Request as EngineRequest
from miles.backends.sglang_utils.reference_engine.serving import answers, json_body, submit
from miles.backends.sglang_utils.reference_engine.vision_inputs import PromptImages, no_vision_tower
from miles.backends.sglang_utils.tool_calls import (
    TOOL_CALL_START,
    held_back,
    parse_tool_calls,
)

if TYPE_CHECKING:
    from miles.backends.sglang_utils.reference_engine.engine import ReferenceEngine


def add_openai_routes(app: FastAPI, engine: ReferenceEngine) -> None:
    @app.get("/v1/models")
    async def models():
        card = {"id": engine.model_name, "object": "model", "created": now(),
                "owned_by": "miles", "root": engine.config.model_path,
                "max_model_len": engine.context_length}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = validate(
            ChatCompletionBody, await json_body(request, engine.config.max_request_bytes)
        )
        prompt, images = await engine.off_loop(render_chat, engine, body)
        top = (body.top_logprobs or 0) if body.logprobs else 0
        parsed = _sequences(
            engine, body, [prompt], body.max_new_tokens, body.logprobs, top, images=[images]
        )
        chat = _Chat(engine, body, completion_id("chatcmpl"), now())
        return await _respond(request, engine, parsed, chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = validate(CompletionBody, await json_body(request, engine.config.max_request_bytes))
        prompts = await engine.off_loop(_tokenize_prompts, engine, body)
        top = body.logprobs or 0
        parsed = _sequences(engine, body, prompts, body.max_tokens, body.logprobs is not None, top)
        text = _Text(engine, body, completion_id("cmpl"), now(), [len(p) for p in prompts])
        return await _respond(request, engine, parsed, text)


async def _respond(
    request: Request, engine: ReferenceEngine, parsed: ParsedGenerate, answer: _Chat | _Text
) -> Response:
    """Queue the sequences; stream their events, or answer once all are done."""
    loop = asyncio.get_running_loop()
    if parsed.stream:
        return _event_stream(answer.stream(_updates(engine, parsed, loop)))
    futures, queued = submit(engine, parsed, loop, None)
    done = await answers(request, engine, futures, queued)
    if done is None:  # the client hung up: its sequences are aborted
        return Response(status_code=499)
    return _failure(done) or JSONResponse(answer.answer(done))


def _engine_error(request: EngineRequest) -> str | None:
    """The message of a sequence the engine ended on a failure (not an abort someone asked for)."""
    reason = request.finish_reason or {}
    failed = reason.get("type") == "abort" and (reason.get("status_code") or 0) >= 500
    return reason.get("message") or "engine error" if failed else None


def _failure(done: list[EngineRequest]) -> JSONResponse | None:
    message = next((m for m in map(_engine_error, done) if m), None)
    if message is None:
        return None
    error = {"message": message, "type": "server_error", "param": None, "code": 500}
    return JSONResponse({"error": error}, status_code=500)


# -- prompts and sequences ----------------------------------------------------------------------


def render_chat(
    engine: ReferenceEngine, body: ChatCompletionBody
) -> tuple[list[int], PromptImages | None]:
    """The prompt's token ids, `input_ids` as given, else the messages through the template, and
    its images (`image_url` parts), whose placeholders a vision-language model's processor
    expands."""
    images = _chat_images(engine, body)
    if body.input_ids is not None:
        if engine.vision is None:
            return list(body.input_ids), None
        return engine.vision.read(list(body.input_ids), images, "messages")
    chars = sum(len(json.dumps(m.for_template())) for m in body.messages)
    if chars > engine.limits.max_text_chars:
        raise InvalidRequestError(
            f"the messages have {chars} characters, more than the {engine.limits.max_text_chars} "
            "that can fit the context length",
            param="messages",
        )
    tools = None
    if body.tools and body.tool_choice != "none":
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    if not getattr(engine.tokenizer, "chat_template", None):
        raise InvalidRequestError(
            f"{engine.config.model_path} has no chat template: send input_ids, or use "
            "/v1/completions with a prompt",
            param="messages",
        )
    try:
        text = engine.tokenizer.apply_chat_template(
            [m.for_template() for m in body.messages],
            tools=tools,
            add_generation_prompt=True,
            tokenize=False,
            **(body.chat_template_kwargs or {}),
        )
    except Exception as err:  # the template's own checks (jinja's raise_exception) and errors
        raise InvalidRequestError(
            f"the chat template cannot render these messages: {type(err).__name__}: {err}",
            param="messages",
        ) from None
    if len(text) > engine.limits.max_text_chars:
        raise InvalidRequestError(
            f"the rendered prompt has {len(text)} characters, more than the "
            f"{engine.limits.max_text_chars} that can fit the context length",
            param="messages",
        )
    if engine.vision is not None:
        ids, prompt_images = engine.vision.read(text, images, "messages")
    else:
        ids, prompt_images = engine.tokenizer.encode(text, add_special_tokens=False), None
    if not ids:
        raise InvalidRequestError("the messages render to an empty prompt", param="messages")
    return ids, prompt_images


def _chat_images(engine: ReferenceEngine, body: ChatCompletionBody) -> list[Image.Image]:
    """The images of the messages' `image_url` parts, in order, each named by its place."""
    sources = [
        (f"messages[{i}].content[{j}].image_url.url", part.image_url.url)
        for i, message in enumerate(body.messages)
        if isinstance(message.content, list)
        for j, part in enumerate(message.content)
        if isinstance(part, ImagePart)
    ]
    if sources and engine.vision is None:
        raise no_vision_tower(len(sources), "messages")
    return [load_image(url, param) for param, url in sources]


def _tokenize_prompts(engine: ReferenceEngine, body: CompletionBody) -> list[list[int]]:
    prompts = []
    for index, prompt in enumerate(body.prompts):
        if isinstance(prompt, str):
            if len(prompt) > engine.limits.max_text_chars:
                raise InvalidRequestError(
                    f"prompt[{index}] has {len(prompt)} characters, more than the "
                    f"{engine.limits.max_text_chars} that can fit the context length",
                    param="prompt",
                )
            prompt = engine.tokenize(prompt)
            if not prompt:
                raise InvalidRequestError(f"prompt[{index}] tokenizes to nothing", param="prompt")
        prompts.append(list(prompt))
    return prompts


def _sequences(
    engine: ReferenceEngine,
    body: ChatCompletionBody | CompletionBody,
    prompts: list[list[int]],
    max_new_tokens: int | None,
    return_logprob: bool,
    top_logprobs: int,
    *,
    images: list[PromptImages | None] | None = None,
) -> ParsedGenerate:
    """`n` sequences per prompt (prompt-major), checked against the engine before queueing;
    `images`: each prompt's (a chat prompt's `image_url` parts)."""
    sequences = []
    count = len(prompts) * body.n
    adapter = _adapter_in(engine, body.model)
    for prompt, prompt_images in zip(prompts, images or [None] * len(prompts), strict=True):
        engine.validate(SequenceSpec("", prompt, SamplingParams(), False))  # the prompt alone
        room = engine.context_length - len(prompt)
        if max_new_tokens is not None and max_new_tokens > room:
            raise InvalidRequestError(
                f"a prompt of {len(prompt)} tokens and max_tokens={max_new_tokens} pass the "
                f"context length {engine.context_length}; ask for at most {max(room, 0)} tokens",
                param="max_tokens",
            )
        params = body.sampling_params(max_new_tokens or max(room, 1))
        for copy in range(body.n):
            seeded = (
                params
                if params.seed is None
                else dataclasses.replace(params, seed=params.seed + copy)
            )
            rid = body.rid if body.rid is None or count == 1 else f"{body.rid}-{len(sequences)}"
            spec = SequenceSpec(
                rid or "",
                prompt,
                seeded,
                return_logprob,
                top_logprobs,
                lora_path=adapter,
                images=prompt_images,
            )
            sequences.append(spec)
    if len(sequences) > engine.limits.max_sequences:
        raise InvalidRequestError(
            f"{len(prompts)} prompt(s) x n={body.n} is {len(sequences)} sequences, over this "
            f"engine's {engine.limits.max_sequences} per request; split the request",
            param="n",
        )
    engine.check_queue(len(sequences))
    return ParsedGenerate(sequences, is_batch=True, stream=body.stream)


def _adapter_in(engine: ReferenceEngine, model: str) -> str | None:
    """The adapter SGLang's `model: "<base>:<adapter>"` names, on an engine serving LoRA (elsewhere
    `model` is a label, colon or not)."""
    if engine.loras is None or ":" not in model:
        return None
    return model.split(":", 1)[1] or None


# -- events of a streamed request ---------------------------------------------------------------


@dataclasses.dataclass
class _Update:
    index: int
    request: EngineRequest
    finished: bool


async def _updates(engine: ReferenceEngine, parsed: ParsedGenerate, loop) -> AsyncIterator[_Update]:
    """Each sequence's progress and its end, as they happen. Progress is coalesced: a reader
    slower than the engine gets one update per sequence with everything new since its last one,
    not a backlog of one per token. When the reader stops (the client hung up), the sequences
    still running are aborted."""
    latest: dict[int, _Update] = {}  # per sequence: the newest update not yet read
    arrived = asyncio.Event()

    def post(update: _Update) -> None:
        waiting = latest.get(update.index)
        if waiting is None or not waiting.finished:  # an end is never overwritten
            latest[update.index] = update
        arrived.set()

    futures, queued = submit(engine, parsed, loop, lambda i, r: post(_Update(i, r, False)))
    for index, future in enumerate(futures):
        future.add_done_callback(lambda f, i=index: post(_Update(i, f.result(), True)))
    pending = set(range(len(futures)))
    try:
        while pending:
            await arrived.wait()
            arrived.clear()
            ready, latest = latest, {}
            for index in sorted(ready):
                if index not in pending:
                    continue
                if ready[index].finished:
                    pending.discard(index)
                yield ready[index]
    finally:
        for index in pending:
            engine.scheduler.abort(rid=queued[index].rid)


def _event_stream(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def encoded() -> AsyncIterator[bytes]:
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(encoded(), media_type="text/event-stream")


class _Streamed:
    """What one streamed choice has sent: text characters and tokens."""

    def __init__(self) -> None:
        self.chars = 0
        self.tokens = 0
        self.token_chars = 0
        """Characters of the token texts sent: the next token's legacy text_offset."""

    def new_tokens(self, request: EngineRequest) -> range:
        fresh = range(self.tokens, len(request.output_ids))
        self.tokens = len(request.output_ids)
        return fresh


def _safe_prefix(text: str, stops: list[str]) -> str:
    """The part of partial output that can be sent now: not a trailing partial UTF-8 character,
    nor anything a stop string, which the final text cuts off, might still begin."""
    text = text.removesuffix("\ufffd")
    hold = max((len(stop) - 1 for stop in stops), default=0)
    for stop in stops:
        at = text.find(stop)
        if at >= 0:
            return text[:at]
    return text[: len(text) - hold] if hold else text


# -- chat answers -------------------------------------------------------------------------------


class _Chat:
    def __init__(self, engine: ReferenceEngine, body: ChatCompletionBody, cid: str, created: int):
        self.engine, self.body, self.id, self.created = engine, body, cid, created

    def _envelope(self, kind: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.body.model, "choices": choices, **extra}  # fmt: skip

    def _logprobs(self, request: EngineRequest, positions: range) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        return {"content": [_token_logprob(self.engine, request, i) for i in positions]}

    def _output(self, request: EngineRequest):
        text = self.engine.final_text(request)
        if self.body.parses_tool_calls:
            return text, parse_tool_calls(text, self.body.tool_names)
        return text, None

    def answer(self, done: list[EngineRequest]) -> dict[str, Any]:
        choices = []
        for index, request in enumerate(done):
            text, parsed = self._output(request)
            calls = parsed.tool_calls if parsed else []
            message = {"role": "assistant", "content": parsed.content if calls else text,
                       "tool_calls": [call.as_openai() for call in calls] or None}  # fmt: skip
            choice = {
                "index": index,
                "message": message,
                "logprobs": self._logprobs(request, range(len(request.output_ids))),
                "finish_reason": finish_reason(request, bool(calls)),
                "matched_stop": matched_stop(request),
            }
            choices.append(self._with_ids(choice, request))
        completion = sum(len(r.output_ids) for r in done)
        return self._envelope(
            "chat.completion", choices, usage=usage(len(done[0].input_ids), completion)
        )

    def _with_ids(self, choice: dict[str, Any], request: EngineRequest) -> dict[str, Any]:
        if self.body.return_prompt_token_ids:
            choice["prompt_token_ids"] = list(request.input_ids)
        if self.body.return_token_ids:
            choice["token_ids"] = list(request.output_ids)
        return choice

    def _chunk(self, index: int, delta: dict, **fields: Any) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None, **fields}
        return self._envelope("chat.completion.chunk", [choice])

    async def stream(self, updates: AsyncIterator[_Update]) -> AsyncIterator[dict[str, Any]]:
        sent = [_Streamed() for _ in range(self.body.n)]
        for index in range(self.body.n):
            yield self._chunk(index, {"role": "assistant", "content": ""})
        prompt_tokens = completion_tokens = 0
        async for update in updates:
            request, mine = update.request, sent[update.index]
            if not update.finished:
                visible = self._visible(self.engine.decode(request.output_ids))
                fresh = visible[mine.chars :]
                positions = mine.new_tokens(request)
                if fresh or (self.body.logprobs and positions):
                    mine.chars += len(fresh)
                    yield self._chunk(update.index, {"content": fresh},
                                      logprobs=self._logprobs(request, positions))  # fmt: skip
                continue
            if (failure := _engine_error(request)) is not None:
                yield {"error": {"message": failure, "type": "server_error", "code": 500}}
                return
            text, parsed = self._output(request)
            calls = parsed.tool_calls if parsed else []
            # What was streamed is a prefix of the final text (stop strings and tags held back).
            rest = text[: text.index(TOOL_CALL_START)].rstrip() if calls else text
            positions = mine.new_tokens(request)
            if rest[mine.chars :] or (self.body.logprobs and positions):
                yield self._chunk(update.index, {"content": rest[mine.chars :]},
                                  logprobs=self._logprobs(request, positions))  # fmt: skip
            if calls:
                deltas = [call.as_openai(index=k) for k, call in enumerate(calls)]
                yield self._chunk(update.index, {"tool_calls": deltas})
            final = self._chunk(update.index, {}, finish_reason=finish_reason(request, bool(calls)),
                                matched_stop=matched_stop(request))  # fmt: skip
            yield {**final, "choices": [self._with_ids(final["choices"][0], request)]}
            prompt_tokens = len(request.input_ids)
            completion_tokens += len(request.output_ids)
        if self.body.include_usage:
            yield self._envelope(
                "chat.completion.chunk", [], usage=usage(prompt_tokens, completion_tokens)
            )

    def _visible(self, partial: str) -> str:
        """What of a partial output may be streamed as content."""
        visible = _safe_prefix(partial, self.body.stops)
        if self.body.parses_tool_calls:
            if TOOL_CALL_START in visible:
                visible = visible[: visible.index(TOOL_CALL_START)]
            else:
                visible = visible[: len(visible) - held_back(visible)]
            # Whitespace before a call is not content: it waits for what follows it.
            visible = visible.rstrip()
        return visible


def _token_logprob(
    engine: ReferenceEngine, request: EngineRequest, position: int
) -> dict[str, Any]:
    tops = request.output_top_logprobs[position] if request.top_logprobs_num else []
    return engine.spelling.logprob_entry(
        request.output_ids[position], request.output_logprobs[position], tops
    )


# -- completion answers -------------------------------------------------------------------------


class _Text:
    def __init__(
        self,
        engine: ReferenceEngine,
        body: CompletionBody,
        cid: str,
        created: int,
        prompt_lengths: list[int],
    ) -> None:
        self.engine, self.body, self.id, self.created = engine, body, cid, created
        self.prompt_tokens = sum(prompt_lengths)

    def _envelope(self, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.body.model, "choices": choices, **extra}  # fmt: skip

    def _logprobs(
        self, request: EngineRequest, positions: range, offset: int
    ) -> dict[str, Any] | None:
        """The legacy completions shape: parallel lists per token; `offset` is the first
        token's position in the text the tokens spell."""
        if self.body.logprobs is None:
            return None
        tokens = [self.engine.token_text(request.output_ids[i]) for i in positions]
        offsets, at = [], offset
        for token in tokens:
            offsets.append(at)
            at += len(token)
        top = None
        if self.body.logprobs:
            top = []
            for i in positions:
                entries: dict[str, float] = {}  # tokens of the same text: the likeliest stays
                for lp, tid in request.output_top_logprobs[i]:
                    entries.setdefault(self.engine.token_text(tid), lp)
                top.append(entries)
        return {"tokens": tokens, "token_logprobs": [request.output_logprobs[i] for i in positions],
                "top_logprobs": top, "text_offset": offsets}  # fmt: skip

    def _choice(self, index: int, request: EngineRequest, text: str, positions: range,
                offset: int, finished: bool) -> dict[str, Any]:  # fmt: skip
        choice = {"index": index, "text": text,
                  "logprobs": self._logprobs(request, positions, offset),
                  "finish_reason": finish_reason(request, False) if finished else None,
                  "matched_stop": matched_stop(request) if finished else None}  # fmt: skip
        if finished and self.body.return_token_ids:
            choice["token_ids"] = list(request.output_ids)
            choice["prompt_token_ids"] = list(request.input_ids)
        return choice

    def answer(self, done: list[EngineRequest]) -> dict[str, Any]:
        choices = [
            self._choice(i, r, self.engine.final_text(r), range(len(r.output_ids)), 0, True)
            for i, r in enumerate(done)
        ]
        completion = sum(len(r.output_ids) for r in done)
        return self._envelope(choices, usage=usage(self.prompt_tokens, completion))

    async def stream(self, updates: AsyncIterator[_Update]) -> AsyncIterator[dict[str, Any]]:
        sent = [_Streamed() for _ in range(len(self.body.prompts) * self.body.n)]
        completion_tokens = 0
        async for update in updates:
            request, mine = update.request, sent[update.index]
            if update.finished:
                text = self.engine.final_text(request)
                completion_tokens += len(request.output_ids)
            else:
                text = _safe_prefix(self.engine.decode(request.output_ids), self.body.stops)
            if update.finished and (failure := _engine_error(request)) is not None:
                yield {"error": {"message": failure, "type": "server_error", "code": 500}}
                return
            fresh = text[mine.chars :]
            offset, positions = mine.token_chars, mine.new_tokens(request)
            if fresh or update.finished or (self.body.logprobs is not None and positions):
                mine.chars += len(fresh)
                mine.token_chars += sum(
                    len(self.engine.token_text(request.output_ids[i])) for i in positions
                )
                choice = self._choice(
                    update.index, request, fresh, positions, offset, update.finished
                )
                yield self._envelope([choice])
        if self.body.include_usage:
            yield self._envelope([], usage=usage(self.prompt_tokens, completion_tokens))
