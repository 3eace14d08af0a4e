"""SGLang's LoRA routes of the reference engine: `POST /load_lora_adapter` (`lora_name`,
`lora_path`, `pinned`) and `POST /unload_lora_adapter` (`lora_name`). Both answer SGLang's
LoRAUpdateOutput, `{success, error_message, loaded_adapters: {name: path}}`, with 200 or (refused)
400. They are admin routes (`guard.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from miles.backends.sglang_utils.reference_engine.errors import InvalidRequestError
from miles.backends.sglang_utils.reference_engine.request_models import (
    LoadLoraBody,
    UnloadLoraBody,
    validate_body,
)
from miles.backends.sglang_utils.reference_engine.serving import json_body

if TYPE_CHECKING:
    from miles.backends.sglang_utils.reference_engine.engine import ReferenceEngine
    from miles.backends.sglang_utils.reference_engine.lora_registry import LoraRegistry

_NOT_ENABLED = (
    "LoRA is not enabled: start the engine with --enable-lora (with --max-lora-rank and "
    "--lora-target-modules, or --lora-paths)"
)


def add_lora_routes(app: FastAPI, engine: ReferenceEngine) -> None:
    """/load_lora_adapter and /unload_lora_adapter on `app`, answered by `engine`."""

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = validate_body(LoadLoraBody, await json_body(request))
        # Reading the directory is file work: off the event loop. Running requests are untouched.
        return await _update(
            engine.loras,
            lambda loras: asyncio.to_thread(
                loras.load, body.lora_name, body.lora_path, body.pinned
            ),
        )

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = validate_body(UnloadLoraBody, await json_body(request))
        return await _update(
            engine.loras, lambda loras: asyncio.to_thread(loras.unload, body.lora_name)
        )


async def _update(
    loras: LoraRegistry | None, change: Callable[[LoraRegistry], Awaitable[object]]
) -> JSONResponse:
    """SGLang's LoRAUpdateOutput for `change(loras)`: a refusal is `success: false` with 400."""
    if loras is None:
        return _answer(False, _NOT_ENABLED, {})
    try:
        await change(loras)
    except InvalidRequestError as err:
        return _answer(False, str(err), loras.loaded_paths())
    return _answer(True, "", loras.loaded_paths())


def _answer(success: bool, message: str, loaded: dict[str, str]) -> JSONResponse:
    body = {"success": success, "error_message": message, "loaded_adapters": loaded}
    return JSONResponse(body, status_code=200 if success else 400)
