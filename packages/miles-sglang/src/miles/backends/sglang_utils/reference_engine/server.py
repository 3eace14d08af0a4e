"""The reference engine's HTTP server: SGLang's native API over FastAPI, for any transformers
causal LM, on CPU or GPU.

Mutating routes accept POST only. Every body is typed and range-checked before anything is
queued: bad input is a 400 naming the field and its value, and never reaches the decode step
other requests share. Any other failure is a JSON 500 on a connection that stays open. A client
that hangs up stops its sequences. Limits: --max-request-bytes per body, a prompt's text length
before it is tokenized (off the event loop), --max-queued-requests (503 with Retry-After past it).
Admin routes (weights, memory, pause, abort) take --admin-api-key when it is set.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.backends.sglang_utils import fast_json
from miles.backends.sglang_utils.reference_engine.config import ReferenceEngineConfig
from miles.backends.sglang_utils.reference_engine.model_runner import ModelRunner
from miles.backends.sglang_utils.reference_engine.openai_routes import add_openai_routes
from miles.backends.sglang_utils.reference_engine.request_models import (
    AbortBody,
    DiskUpdateBody,
    DistributedUpdateBody,
    GroupBody,
    InitGroupBody,
    MemoryBody,
    PauseBody,
    TensorUpdateBody,
    validate_body,
)
from miles.backends.sglang_utils.reference_engine.requests import (
    GenerateLimits,
    ParsedGenerate,
    SequenceSpec,
    parse_generate,
    response_item,
)
from miles.backends.sglang_utils.reference_engine.sampling import (
    InvalidRequestError,
    SamplingParams,
)
from miles.backends.sglang_utils.reference_engine.scheduler import Request as EngineRequest
from miles.backends.sglang_utils.reference_engine.scheduler import Scheduler
from miles.backends.sglang_utils.reference_engine.serving import (
    RequestTooLargeError,
    answers,
    json_body,
    submit,
)
from miles.backends.sglang_utils.reference_engine.weights import WeightManager, check_tags
from miles.backends.sglang_utils.token_spelling import TokenSpelling
from miles.backends.sglang_utils.weight_sync import DISTRIBUTED_LOAD_FORMATS, FLATTENED_BUCKET
from miles.backends.training_utils.infra.device import get_torch_device

logger = logging.getLogger(__name__)
VERSION = "miles-reference-engine/1"


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 413: "request_too_large",
                503: "overloaded_error"}  # fmt: skip
# Routes that change the engine's weights or state, or cut into others' requests: they take the
# admin key (--admin-api-key) when one is set. /health and /health_generate stay open, as in
# SGLang: routers and orchestrators poll them keyless.
ADMIN_ROUTES = frozenset({
    "/update_weights_from_tensor", "/update_weights_from_disk", "/init_weights_update_group",
    "/update_weights_from_distributed", "/destroy_weights_update_group",
    "/release_memory_occupation", "/resume_memory_occupation", "/pause_generation",
    "/continue_generation", "/abort_request", "/flush_cache",
})  # fmt: skip
OPEN_ROUTES = frozenset({"/health", "/health_generate"})
# A token is at least one character of text: a longer prompt cannot fit, so it is refused before
# the tokenizer spends seconds on it.
_MAX_CHARS_PER_TOKEN = 64
# How long a client refused for a full queue should wait before it tries again.
_RETRY_AFTER_S = 1


def _error(
    status: int, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    error = {"message": message, "type": _ERROR_TYPES.get(status, "server_error"),
             "param": param, "code": status}  # fmt: skip
    return JSONResponse({"error": error}, status_code=status, headers=headers)


class QueueFullError(RuntimeError):
    """More requests wait than --max-queued-requests: refused, to be retried (503)."""


class ReferenceEngine:
    """The model, tokenizer, loop and weight manager behind one server."""

    def __init__(self, config: ReferenceEngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.random_seed)
        self.device = torch.device(config.device) if config.device else get_torch_device(0)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=config.torch_dtype)
        self.model_config = model.config
        self.context_length = config.context_length or int(
            getattr(model.config, "max_position_embeddings", 4096)
        )
        self.scheduler = Scheduler(
            ModelRunner(
                model,
                self.device,
                record_routed_experts=config.enable_return_routed_experts,
                fast_decode=not config.disable_fast_decode,
            ),
            eos_token_ids=self._eos_ids(model),
            context_length=self.context_length,
            max_running_requests=config.max_running_requests,
            seed=config.random_seed,
            admission_quiet_s=config.admission_quiet_ms / 1000,
        )
        self.weights = WeightManager(self.scheduler, self.scheduler.runner.model, self.device)
        self.limits = GenerateLimits(
            max_text_chars=self.context_length * _MAX_CHARS_PER_TOKEN,
            max_sequences=config.max_queued_requests,
        )
        # One thread tokenizes, off the event loop: a long prompt does not stall /health, and a
        # fast tokenizer is never entered from two threads at once.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.spelling = TokenSpelling(self.tokenizer)

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.config.model_path

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in the tokenizer's thread: text work never stalls the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def token_text(self, token_id: int) -> str:
        return self.spelling.text(token_id)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token decoded alone, as SGLang's return_text_in_logprobs does it."""
        # transformers 5 decodes an empty batch to [""].
        return self.tokenizer.batch_decode([[token] for token in ids]) if ids else []

    async def parse(self, body: Any) -> ParsedGenerate:
        """A /generate body, validated; text is tokenized off the event loop."""
        if not (isinstance(body, dict) and body.get("text") is not None):
            return parse_generate(body, self.tokenize, self.limits)  # token ids: nothing slow
        return await self.off_loop(parse_generate, body, self.tokenize, self.limits)

    def check_queue(self, sequences: int) -> None:
        """Refuse `sequences` more when the wait queue would grow past --max-queued-requests."""
        waiting = self.scheduler.num_waiting
        if waiting + sequences > self.config.max_queued_requests:
            raise QueueFullError(
                f"{waiting} requests wait already; {sequences} more would pass "
                f"--max-queued-requests {self.config.max_queued_requests}: retry shortly"
            )

    def _eos_ids(self, model) -> set[int]:
        ids = model.generation_config.eos_token_id if model.generation_config else None
        ids = ids if ids is not None else self.tokenizer.eos_token_id
        return set(ids if isinstance(ids, list) else [ids]) - {None}

    def tokenize(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"text must be a string or a list of strings, got {type(text).__name__}"
            )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def validate(self, spec: SequenceSpec) -> None:
        vocab = self.model_config.vocab_size
        if max(spec.input_ids) >= vocab:
            raise InvalidRequestError(
                f"input_ids contain token id {max(spec.input_ids)} >= vocab size {vocab}"
            )
        if spec.token_ids_logprob and max(spec.token_ids_logprob) >= vocab:
            raise InvalidRequestError(
                f"token_ids_logprob contains token id {max(spec.token_ids_logprob)} >= vocab "
                f"size {vocab}",
                param="token_ids_logprob",
            )
        if len(spec.input_ids) >= self.context_length:
            raise InvalidRequestError(
                f"prompt of {len(spec.input_ids)} tokens does not fit the context length "
                f"{self.context_length} (--context-length); shorten it"
            )
        if "weights" in self.weights.released or "kv_cache" in self.weights.released:
            raise InvalidRequestError(
                "memory is released; call /resume_memory_occupation before generating"
            )

    def stop_checker(self, params: SamplingParams) -> Callable[[EngineRequest], str | None] | None:
        if not params.stop:
            return None

        def check(request: EngineRequest) -> str | None:
            text = self.decode(request.output_ids)
            return next((s for s in params.stop if s in text), None)

        return check

    def final_text(self, request: EngineRequest) -> str:
        text = self.decode(request.output_ids)
        matched = (request.finish_reason or {}).get("matched")
        if isinstance(matched, str) and not self._params_of(request).no_stop_trim:
            text = text[: text.find(matched)] if matched in text else text
        return text

    @staticmethod
    def _params_of(request: EngineRequest) -> SamplingParams:
        return request.params

    def server_info(self) -> dict[str, Any]:
        info = asdict(self.config)
        for key in ("api_key", "admin_api_key"):  # said to be set, never echoed
            info[key] = "(set)" if info[key] else None
        info.update(
            version=VERSION,
            pid=os.getpid(),
            weight_version=self.scheduler.weight_version,
            context_length=self.context_length,
            max_total_num_tokens=self.context_length * self.config.max_running_requests,
            **{DISTRIBUTED_LOAD_FORMATS: [FLATTENED_BUCKET]},
            internal_states=[
                {
                    "num_running": self.scheduler.num_running,
                    "num_waiting": self.scheduler.num_waiting,
                    "paused": self.scheduler.paused,
                    "finished_requests": self.scheduler.finished_requests,
                    "decode_steps": self.scheduler.steps,
                    "prefilled_tokens": self.scheduler.runner.prefilled_tokens,
                    "step_seconds": dict(self.scheduler.step_seconds),
                }
            ],
        )
        return info


def _authorized(presented: bytes | None, *keys: str | None) -> bool:
    given = presented or b""
    # Every set key is compared, in constant time, so the answer's timing says nothing of which.
    return any([hmac.compare_digest(given, f"Bearer {key}".encode()) for key in keys if key])


class _Guard:
    """The keys (which route takes which key) and the last resort for failures: an exception
    no handler answered becomes a JSON 500 on a connection that stays open (a re-raised one
    would make the server drop it, and with it the client's pooled connection)."""

    def __init__(self, app: Any, *, api_key: str | None, admin_key: str | None) -> None:
        self.app, self.api_key, self.admin_key = app, api_key, admin_key

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        refusal = self._refusal(path, dict(scope["headers"]).get(b"authorization"))
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as err:
            if started:  # half an answer is out: nothing left to do but close
                raise
            logger.exception("%s %s failed", scope["method"], path)
            answer = _error(500, f"internal error in {path}: {type(err).__name__}: {err}")
            await answer(scope, receive, send)

    def _refusal(self, path: str, presented: bytes | None) -> JSONResponse | None:
        if path in OPEN_ROUTES:
            return None
        if path in ADMIN_ROUTES:
            required = (self.admin_key,) if self.admin_key else (self.api_key,)
            what = "the admin key (--admin-api-key)" if self.admin_key else "the API key"
        else:  # inference and info: the API key, or the admin key that outranks it
            required = (self.api_key, self.admin_key) if self.api_key else ()
            what = "the API key"
        if any(required) and not _authorized(presented, *required):
            return _error(401, f"{path} needs {what}: send 'Authorization: Bearer <key>'")
        return None


def create_app(engine: ReferenceEngine) -> FastAPI:
    app = FastAPI(title="miles reference engine")
    api_key, admin_key = engine.config.api_key, engine.config.admin_api_key

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, err: InvalidRequestError):
        status = 413 if isinstance(err, RequestTooLargeError) else 400
        return _error(status, str(err), param=err.param)

    @app.exception_handler(QueueFullError)
    async def queue_full(request: Request, err: QueueFullError):
        return _error(503, str(err), headers={"Retry-After": str(_RETRY_AFTER_S)})

    # One plain ASGI layer for keys and failures: Starlette's decorator middleware costs a task
    # group and a response stream per request, which a loaded engine feels.
    app.add_middleware(_Guard, api_key=api_key, admin_key=admin_key)

    async def run(fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(engine.scheduler.run_command(fn))

    async def action(fn: Callable[[], Awaitable[str] | str]) -> JSONResponse:
        try:
            result = fn()
            message = await result if asyncio.iscoroutine(result) else result
        except InvalidRequestError as err:
            return JSONResponse({"success": False, "message": str(err)}, status_code=400)
        return JSONResponse({"success": True, "message": message})

    async def generate(request: Request):
        parsed = await engine.parse(await json_body(request, engine.config.max_request_bytes))
        for spec in parsed.sequences:
            engine.validate(spec)
        engine.check_queue(len(parsed.sequences))
        loop = asyncio.get_running_loop()
        if parsed.stream:
            return StreamingResponse(_stream(engine, parsed, loop), media_type="text/event-stream")
        futures, requests = submit(engine, parsed, loop, None)
        done = await answers(request, engine, futures, requests)
        if done is None:  # nobody waits for the answer: its slots are free again
            return Response(status_code=499)
        items = [
            response_item(r, engine.final_text(r), spec, engine.token_texts)
            for r, spec in zip(done, parsed.sequences, strict=True)
        ]
        answer = fast_json.dumps(items if parsed.is_batch else items[0])
        return Response(answer, media_type="application/json")

    # A plain Starlette route: the handler takes the raw request, so FastAPI's per-call work
    # (dependency solving, exit stacks, telemetry) buys nothing here, and a rollout's requests
    # are handled one after the other before the first prefill. Exception handlers still apply;
    # the route is left out of the OpenAPI page.
    app.add_route("/generate", generate, methods=["POST"])

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        if engine.weights.released:
            return _error(503, f"memory released: {sorted(engine.weights.released)}")
        spec = SequenceSpec("", [0], SamplingParams(max_new_tokens=1, temperature=0.0), False)
        loop = asyncio.get_running_loop()
        futures, _ = submit(engine, ParsedGenerate([spec], False, False), loop, None)
        try:
            await asyncio.wait_for(asyncio.gather(*futures), 60)
        except TimeoutError:
            return _error(
                503, "a 1-token generation did not finish in 60 s (engine paused or busy)"
            )
        return Response(status_code=200)

    @app.get("/get_server_info")
    async def get_server_info():
        return engine.server_info()

    @app.get("/get_model_info")
    async def get_model_info():
        return {
            "model_path": engine.config.model_path,
            "tokenizer_path": engine.config.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.scheduler.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(engine.model_config, "model_type", None),
            "architectures": getattr(engine.model_config, "architectures", None),
        }

    @app.post("/flush_cache")
    async def flush_cache():
        # No prefix cache survives a request here; returning cached allocator blocks is all
        # there is to flush.
        await run(lambda: torch.cuda.empty_cache() if engine.device.type == "cuda" else None)
        return Response("Cache flushed.", status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        mode = validate_body(PauseBody, await json_body(request)).mode
        engine.scheduler.pause()
        if mode == "abort":
            engine.scheduler.abort(abort_all=True)
        return JSONResponse({"success": True, "message": f"paused ({mode})"})

    @app.post("/continue_generation")
    async def continue_generation():
        engine.scheduler.resume()
        return JSONResponse({"success": True, "message": "generation continues"})

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = validate_body(AbortBody, await json_body(request))
        engine.scheduler.abort(rid=body.rid, abort_all=body.abort_all)
        return Response(status_code=200)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        body = validate_body(TensorUpdateBody, await json_body(request))
        return await action(
            lambda: run(
                lambda: engine.weights.from_tensor(
                    body.serialized_named_tensors, body.load_format, body.weight_version
                )
            )
        )

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = validate_body(DiskUpdateBody, await json_body(request))
        return await action(
            lambda: run(lambda: engine.weights.from_disk(body.model_path, body.weight_version))
        )

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = validate_body(InitGroupBody, await json_body(request))
        # Joining blocks until the trainer joins too: run it off the event loop and engine loop.
        return await action(
            lambda: asyncio.to_thread(engine.weights.init_group, **body.model_dump())
        )

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = validate_body(DistributedUpdateBody, await json_body(request))
        return await action(
            lambda: run(lambda: engine.weights.from_distributed(**body.model_dump()))
        )

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        body = validate_body(GroupBody, await json_body(request))
        return await action(lambda: run(lambda: engine.weights.destroy_group(body.group_name)))

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request):
        tags = check_tags(validate_body(MemoryBody, await json_body(request)).tags)
        if not engine.scheduler.wait_idle(timeout_s=0.0):
            raise InvalidRequestError(
                "requests are running; pause or wait for them before releasing memory"
            )
        return await action(lambda: run(lambda: engine.weights.release(tags)))

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request):
        tags = check_tags(validate_body(MemoryBody, await json_body(request)).tags)
        return await action(lambda: run(lambda: engine.weights.resume(tags)))

    add_openai_routes(app, engine)
    return app


async def _stream(engine: ReferenceEngine, parsed: ParsedGenerate, loop) -> AsyncIterator[bytes]:
    """Server-sent events as SGLang sends them: the cumulative result so far, then [DONE]."""
    updates: asyncio.Queue = asyncio.Queue()
    futures, requests = submit(
        engine, parsed, loop, lambda index, request: updates.put_nowait((index, request))
    )
    pending = set(range(len(futures)))
    for index, future in enumerate(futures):
        future.add_done_callback(lambda f, index=index: updates.put_nowait((index, None)))
    started = time.monotonic()
    try:
        while pending:
            index, request = await updates.get()
            spec = parsed.sequences[index]
            if request is None:
                pending.discard(index)
                request = futures[index].result()
                text = engine.final_text(request)
            else:
                text = engine.decode(request.output_ids)
            item = response_item(request, text, spec, engine.token_texts)
            item["index"] = index
            yield f"data: {json.dumps(item)}\n\n".encode()
    finally:
        # The client hung up (the response task is cancelled) or a send failed: nobody reads
        # what is left, so its sequences stop decoding.
        for index in pending:
            engine.scheduler.abort(rid=requests[index].rid)
    logger.debug("stream of %d sequences done in %.2f s", len(futures), time.monotonic() - started)
    yield b"data: [DONE]\n\n"
