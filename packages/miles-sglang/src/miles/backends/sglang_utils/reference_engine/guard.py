"""The one ASGI layer in front of every route of the reference engine: which route takes which key
(--api-key, --admin-api-key), and the last resort that turns a failure no handler answered into a
JSON 500 on a connection that stays open.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from miles.backends.sglang_utils.reference_engine.serving import error_response

logger = logging.getLogger(__name__)

# Routes that change the engine's weights (LoRA adapters too) or state, or cut into others'
# requests: they take the admin key (--admin-api-key) when one is set. /health and
# /health_generate stay open, as in SGLang: routers and orchestrators poll them keyless.
ADMIN_ROUTES = frozenset({
    "/update_weights_from_tensor", "/update_weights_from_disk", "/init_weights_update_group",
    "/update_weights_from_distributed", "/destroy_weights_update_group",
    "/release_memory_occupation", "/resume_memory_occupation", "/pause_generation",
    "/continue_generation", "/abort_request", "/flush_cache", "/load_lora_adapter",
    "/unload_lora_adapter", "/update_weight_version", "/start_profile", "/stop_profile",
})  # fmt: skip
OPEN_ROUTES = frozenset({"/health", "/health_generate"})


def _authorized(presented: bytes | None, *keys: str | None) -> bool:
    given = presented or b""
    # Every set key is compared, in constant time, so the answer's timing says nothing of which.
    return any([hmac.compare_digest(given, f"Bearer {key}".encode()) for key in keys if key])


class Guard:
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
            answer = error_response(500, f"internal error in {path}: {type(err).__name__}: {err}")
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
            return error_response(401, f"{path} needs {what}: send 'Authorization: Bearer <key>'")
        return None
