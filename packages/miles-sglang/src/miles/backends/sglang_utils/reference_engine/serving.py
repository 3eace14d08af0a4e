"""What the reference engine's routes do alike: answer an error in one JSON shape, read a bounded
JSON body, queue sequences on the scheduler with futures for their ends, and notice a client
hanging up."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse

from miles.backends.sglang_utils import fast_json
from miles.backends.sglang_utils.reference_engine.errors import (
    InvalidRequestError,
    RequestTooLargeError,
)
from miles.backends.sglang_utils.reference_engine.requests import ParsedGenerate
from miles.backends.sglang_utils.reference_engine.scheduler import Request as EngineRequest

if TYPE_CHECKING:
    from miles.backends.sglang_utils.reference_engine.engine import ReferenceEngine


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 413: "request_too_large",
                503: "overloaded_error"}  # fmt: skip


def error_response(
    status: int, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An error answer in the shape every route uses: `{"error": {message, type, param, code}}`."""
    error = {"message": message, "type": _ERROR_TYPES.get(status, "server_error"),
             "param": param, "code": status}  # fmt: skip
    return JSONResponse({"error": error}, status_code=status, headers=headers)


def submit(
    engine: ReferenceEngine, parsed: ParsedGenerate, loop, on_update
) -> tuple[list[asyncio.Future], list[EngineRequest]]:
    """Queue every sequence; their futures (set when each finishes) and engine requests."""
    futures, requests = [], []
    if not engine.config.enable_return_routed_experts and any(
        spec.return_routed_experts for spec in parsed.sequences
    ):
        raise InvalidRequestError(
            "return_routed_experts needs the engine started with --enable-return-routed-experts",
            param="return_routed_experts",
        )
    adapters = engine.adapters_for(parsed.sequences)  # all resolved before any is queued
    for index, (spec, adapter) in enumerate(zip(parsed.sequences, adapters, strict=True)):
        future = loop.create_future()

        def on_event(request: EngineRequest, finished: bool, future=future, index=index) -> None:
            if finished:
                loop.call_soon_threadsafe(lambda: future.done() or future.set_result(request))
            elif on_update is not None:
                loop.call_soon_threadsafe(on_update, index, request)

        request = EngineRequest(
            input_ids=spec.input_ids,
            params=spec.params,
            on_event=on_event,
            stop_checker=engine.stop_checker(spec.params),
            top_logprobs_num=spec.top_logprobs_num,
            logprob_start_len=spec.logprob_start_len,
            token_ids_logprob=spec.token_ids_logprob,
            return_routed_experts=spec.return_routed_experts,
            adapter=adapter,
            images=spec.images,
        )
        if spec.rid:
            request.rid = spec.rid
        engine.scheduler.submit(request)
        futures.append(future)
        requests.append(request)
    return futures, requests


async def json_body(request: Request, max_bytes: int | None = None) -> Any:
    """The request's JSON (an empty body is `{}`); a body past `max_bytes` is refused unread."""
    declared = request.headers.get("content-length")
    if max_bytes is not None and declared and declared.isdigit() and int(declared) > max_bytes:
        raise RequestTooLargeError(
            f"the body has {declared} bytes, over --max-request-bytes {max_bytes}"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if max_bytes is not None and size > max_bytes:
            raise RequestTooLargeError(f"the body is over --max-request-bytes {max_bytes}")
        chunks.append(chunk)
    raw = b"".join(chunks) or b"{}"
    try:
        body = fast_json.loads(raw)
    except ValueError as err:  # invalid JSON, or bytes that are not UTF-8
        raise InvalidRequestError(f"the body is not valid JSON: {err}") from None
    except RecursionError:
        raise InvalidRequestError("the body is not valid JSON: nested too deeply") from None
    # A lone surrogate comes from a \u escape (a backslash byte) or from encoded surrogate bytes,
    # which json decodes as they are (all past ASCII): a rollout's body of token ids and
    # parameters has neither and is not walked.
    if b"\\" in raw or not raw.isascii():
        _check_unicode(body)
    return body


def _check_unicode(body: Any) -> None:
    """JSON may escape half of a UTF-16 pair ("\\ud800"); such a string is no text a tokenizer
    or a response can take, so it is refused here instead of failing deep inside."""
    pending = [body]
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                raise InvalidRequestError(
                    f"the body holds a lone UTF-16 surrogate in {value[:40]!r}; send valid Unicode"
                ) from None
        elif isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(item for item in value if not isinstance(item, int | float))


async def until_disconnected(request: Request) -> None:
    """Returns when the client hangs up (its request fully read, the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        continue


async def answers(
    request: Request, engine: ReferenceEngine, futures: list[asyncio.Future], queued: list
) -> list[EngineRequest] | None:
    """The finished engine requests, or None when the client hung up first (their sequences
    are aborted: nobody waits for them)."""
    answered = asyncio.gather(*futures)
    hung_up = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({answered, hung_up}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hung_up.cancel()
    if not answered.done():
        for engine_request in queued:
            engine.scheduler.abort(rid=engine_request.rid)
        answered.cancel()
        return None
    return answered.result()
