"""The reference engine's HTTP server: SGLang's native API over FastAPI, for any transformers
causal LM, on CPU or GPU. Mutating routes accept POST only; bad input is a 400 that says what
was wrong, and the engine keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.backends.sglang_utils.reference_engine.config import ReferenceEngineConfig
from miles.backends.sglang_utils.reference_engine.model_runner import ModelRunner
from miles.backends.sglang_utils.reference_engine.requests import (
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
from miles.backends.sglang_utils.reference_engine.weights import WeightManager, check_tags
from miles.backends.training_utils.device import get_torch_device

logger = logging.getLogger(__name__)
VERSION = "miles-reference-engine/1"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


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
            ModelRunner(model, self.device),
            eos_token_ids=self._eos_ids(model),
            context_length=self.context_length,
            max_running_requests=config.max_running_requests,
            seed=config.random_seed,
        )
        self.weights = WeightManager(self.scheduler, self.scheduler.runner.model, self.device)

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
        info.update(
            version=VERSION,
            pid=os.getpid(),
            weight_version=self.scheduler.weight_version,
            context_length=self.context_length,
            max_total_num_tokens=self.context_length * self.config.max_running_requests,
            internal_states=[
                {
                    "num_running": self.scheduler.num_running,
                    "paused": self.scheduler.paused,
                    "finished_requests": self.scheduler.finished_requests,
                    "decode_steps": self.scheduler.steps,
                    "prefilled_tokens": self.scheduler.runner.prefilled_tokens,
                    "step_seconds": dict(self.scheduler.step_seconds),
                }
            ],
        )
        return info


def _submit(
    engine: ReferenceEngine, parsed: ParsedGenerate, loop, on_update
) -> list[asyncio.Future]:
    futures = []
    for spec in parsed.sequences:
        engine.validate(spec)
    for index, spec in enumerate(parsed.sequences):
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
        )
        if spec.rid:
            request.rid = spec.rid
        engine.scheduler.submit(request)
        futures.append(future)
    return futures


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body() or b"{}")
    except json.JSONDecodeError as err:
        raise InvalidRequestError(f"malformed JSON body: {err}") from None


def create_app(engine: ReferenceEngine) -> FastAPI:
    app = FastAPI(title="miles reference engine")
    api_key = engine.config.api_key

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        # Health probes stay open, as in SGLang: routers and orchestrators poll them keyless.
        open_path = request.url.path in ("/health", "/health_generate")
        if (
            api_key
            and not open_path
            and request.headers.get("authorization") != f"Bearer {api_key}"
        ):
            return _error(401, "missing or wrong API key (Authorization: Bearer ...)")
        return await call_next(request)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, err: InvalidRequestError):
        return _error(400, str(err))

    async def run(fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(engine.scheduler.run_command(fn))

    async def action(fn: Callable[[], Awaitable[str] | str]) -> JSONResponse:
        try:
            result = fn()
            message = await result if asyncio.iscoroutine(result) else result
        except InvalidRequestError as err:
            return JSONResponse({"success": False, "message": str(err)}, status_code=400)
        return JSONResponse({"success": True, "message": message})

    @app.post("/generate")
    async def generate(request: Request):
        parsed = parse_generate(await _json_body(request), engine.tokenize)
        loop = asyncio.get_running_loop()
        if parsed.stream:
            return StreamingResponse(_stream(engine, parsed, loop), media_type="text/event-stream")
        futures = _submit(engine, parsed, loop, None)
        done = await asyncio.gather(*futures)
        items = [
            response_item(r, engine.final_text(r), spec.return_logprob)
            for r, spec in zip(done, parsed.sequences, strict=True)
        ]
        return JSONResponse(items if parsed.is_batch else items[0])

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        if engine.weights.released:
            return _error(503, f"memory released: {sorted(engine.weights.released)}")
        spec = SequenceSpec("", [0], SamplingParams(max_new_tokens=1, temperature=0.0), False)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(
                asyncio.gather(*_submit(engine, ParsedGenerate([spec], False, False), loop, None)),
                60,
            )
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
        body = await _json_body(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise InvalidRequestError(f"pause mode {mode!r} is not one of abort, in_place, retract")
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
        body = await _json_body(request)
        engine.scheduler.abort(
            rid=str(body.get("rid") or ""), abort_all=bool(body.get("abort_all", False))
        )
        return Response(status_code=200)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        body = await _json_body(request)
        return await action(
            lambda: run(
                lambda: engine.weights.from_tensor(
                    body.get("serialized_named_tensors") or [],
                    body.get("load_format"),
                    body.get("weight_version"),
                )
            )
        )

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await _json_body(request)
        if not body.get("model_path"):
            raise InvalidRequestError("model_path is required")
        return await action(
            lambda: run(
                lambda: engine.weights.from_disk(body["model_path"], body.get("weight_version"))
            )
        )

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = await _json_body(request)
        keys = (
            "master_address",
            "master_port",
            "rank_offset",
            "world_size",
            "group_name",
            "backend",
        )
        missing = [k for k in keys if k not in body]
        if missing:
            raise InvalidRequestError(f"missing fields {missing}")
        kwargs = {k: body[k] for k in keys}
        # Joining blocks until the trainer joins too: run it off the event loop and engine loop.
        return await action(lambda: asyncio.to_thread(engine.weights.init_group, **kwargs))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = await _json_body(request)
        kwargs = {
            k: body.get(k) for k in ("names", "dtypes", "shapes", "group_name", "weight_version")
        }
        if any(kwargs[k] is None for k in ("names", "dtypes", "shapes", "group_name")):
            raise InvalidRequestError("names, dtypes, shapes and group_name are required")
        return await action(lambda: run(lambda: engine.weights.from_distributed(**kwargs)))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        body = await _json_body(request)
        return await action(
            lambda: run(lambda: engine.weights.destroy_group(str(body.get("group_name"))))
        )

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request):
        tags = check_tags((await _json_body(request)).get("tags"))
        if not engine.scheduler.wait_idle(timeout_s=0.0):
            raise InvalidRequestError(
                "requests are running; pause or wait for them before releasing memory"
            )
        return await action(lambda: run(lambda: engine.weights.release(tags)))

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request):
        tags = check_tags((await _json_body(request)).get("tags"))
        return await action(lambda: run(lambda: engine.weights.resume(tags)))

    return app


async def _stream(engine: ReferenceEngine, parsed: ParsedGenerate, loop) -> AsyncIterator[bytes]:
    """Server-sent events as SGLang sends them: the cumulative result so far, then [DONE]."""
    updates: asyncio.Queue = asyncio.Queue()
    futures = _submit(
        engine, parsed, loop, lambda index, request: updates.put_nowait((index, request))
    )
    pending = set(range(len(futures)))
    for index, future in enumerate(futures):
        future.add_done_callback(lambda f, index=index: updates.put_nowait((index, None)))
    started = time.monotonic()
    while pending:
        index, request = await updates.get()
        spec = parsed.sequences[index]
        if request is None:
            pending.discard(index)
            request = futures[index].result()
            text = engine.final_text(request)
        else:
            text = engine.decode(request.output_ids)
        item = response_item(request, text, spec.return_logprob)
        item["index"] = index
        yield f"data: {json.dumps(item)}\n\n".encode()
    logger.debug("stream of %d sequences done in %.2f s", len(futures), time.monotonic() - started)
    yield b"data: [DONE]\n\n"
