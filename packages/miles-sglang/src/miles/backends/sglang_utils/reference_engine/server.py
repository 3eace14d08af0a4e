"""The reference engine's HTTP server: SGLang's native API over FastAPI, for any transformers
causal LM and the Qwen-VL vision-language models, on CPU or GPU. This module assembles the app (error statuses, the guard, both route
sets); `cli.py` serves it.

Mutating routes accept POST only. Every body is typed and range-checked before anything is
queued: bad input is a 400 naming the field and its value, and never reaches the decode step
other requests share. Any other failure is a JSON 500 on a connection that stays open. A client
that hangs up stops its sequences. Limits: --max-request-bytes per body, a prompt's text length
before it is tokenized (off the event loop), --max-queued-requests (503 with Retry-After past it).
Admin routes (weights, LoRA adapters, memory, pause, abort) take --admin-api-key when it is set.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from miles.backends.sglang_utils.reference_engine.engine import ReferenceEngine
from miles.backends.sglang_utils.reference_engine.errors import (
    InvalidRequestError,
    QueueFullError,
    RequestTooLargeError,
)
from miles.backends.sglang_utils.reference_engine.guard import Guard
from miles.backends.sglang_utils.reference_engine.lora_routes import add_lora_routes
from miles.backends.sglang_utils.reference_engine.openai_routes import add_openai_routes
from miles.backends.sglang_utils.reference_engine.profile_routes import add_profile_routes
from miles.backends.sglang_utils.reference_engine.serving import error_response
from miles.backends.sglang_utils.reference_engine.sglang_routes import add_sglang_routes

# How long a client refused for a full queue should wait before it tries again.
_RETRY_AFTER_S = 1


def create_app(engine: ReferenceEngine) -> FastAPI:
    """The app serving `engine`: SGLang's native routes (LoRA's too) and the OpenAI-compatible
    ones, behind the guard."""
    app = FastAPI(title="miles reference engine")
    api_key, admin_key = engine.config.api_key, engine.config.admin_api_key

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, err: InvalidRequestError):
        status = 413 if isinstance(err, RequestTooLargeError) else 400
        return error_response(status, str(err), param=err.param)

    @app.exception_handler(QueueFullError)
    async def queue_full(request: Request, err: QueueFullError):
        return error_response(503, str(err), headers={"Retry-After": str(_RETRY_AFTER_S)})

    # One plain ASGI layer for keys and failures: Starlette's decorator middleware costs a task
    # group and a response stream per request, which a loaded engine feels.
    app.add_middleware(Guard, api_key=api_key, admin_key=admin_key)

    add_sglang_routes(app, engine)
    add_lora_routes(app, engine)
    add_profile_routes(app, engine)
    add_openai_routes(app, engine)
    return app
