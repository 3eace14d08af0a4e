"""SGLang's native routes of the reference engine: `/generate`, health and info, pause and
abort, weight updates (and `/update_weight_version`) and memory release, with SGLang's field names.
Which key each route takes is the guard's business (`guard.py`); the LoRA adapter routes are in
`lora_routes.py`, the OpenAI-compatible ones in `openai_routes.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from miles.backends.sglang_utils import fast_json
from miles.backends.sglang_utils.reference_engine.errors import InvalidRequestError
from miles.backends.sglang_utils.reference_engine.request_models import (
    AbortBody,
    DiskUpdateBody,
    DistributedUpdateBody,
    GroupBody,
    InitGroupBody,
    MemoryBody,
    PauseBody,
    TensorUpdateBody,
    WeightVersionBody,
    validate_body,
)
from miles.backends.sglang_utils.reference_engine.requests import (
    ParsedGenerate,
    SequenceSpec,
    response_item,
)
from miles.backends.sglang_utils.reference_engine.sampling import SamplingParams
from miles.backends.sglang_utils.reference_engine.serving import (
    answers,
    error_response,
    json_body,
    submit,
)
from miles.backends.sglang_utils.reference_engine.weights import check_tags

if TYPE_CHECKING:
    from miles.backends.sglang_utils.reference_engine.engine import ReferenceEngine

logger = logging.getLogger(__name__)


def add_sglang_routes(app: FastAPI, engine: ReferenceEngine) -> None:
    """Every native route, on `app`, answered by `engine`."""

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
            return error_response(503, f"memory released: {sorted(engine.weights.released)}")
        spec = SequenceSpec("", [0], SamplingParams(max_new_tokens=1, temperature=0.0), False)
        loop = asyncio.get_running_loop()
        futures, _ = submit(engine, ParsedGenerate([spec], False, False), loop, None)
        try:
            await asyncio.wait_for(asyncio.gather(*futures), 60)
        except TimeoutError:
            return error_response(
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
            "has_image_understanding": engine.vision is not None,
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

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = validate_body(WeightVersionBody, await json_body(request))
        if body.abort_all_requests:
            engine.scheduler.abort(abort_all=True)

        def relabel() -> str:
            engine.scheduler.weight_version = body.new_version
            return f"weight version is now {body.new_version}"

        # Between two steps: every token after it carries the new label.
        message = await run(relabel)
        return JSONResponse({"success": True, "message": message, "new_version": body.new_version})

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
