"""`EngineError`, raised by a failed call to an engine or router, and `server_message`, the
server's own words out of an HTTP answer (SGLang's, FastAPI's or plain text). No HTTP client here:
the launchers and the router, which speak httpx, share them with `EngineClient`.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

_MAX_MESSAGE_CHARS = 2000


class HttpAnswer(Protocol):
    """What error reporting reads of an HTTP answer: an httpx.Response, or an `Answer`."""

    @property
    def status_code(self) -> int: ...

    @property
    def reason_phrase(self) -> str: ...

    @property
    def text(self) -> str: ...


class EngineError(RuntimeError):
    """An HTTP call to an engine (or router) failed: its URL, endpoint, status and message."""

    def __init__(
        self,
        url: str,
        endpoint: str,
        status: int | None,
        message: str,
        hint: str = "",
        body: str | None = None,
    ):
        self.url = url
        self.endpoint = endpoint
        self.status = status
        self.server_message = message
        self.body = body
        """The raw answer, when there was one."""
        self.hint = hint
        what = f"HTTP {status}" if status is not None else "no HTTP answer"
        text = f"{endpoint} at {url} failed ({what}): {message}"
        super().__init__(f"{text}; {hint}" if hint else text)

    def __reduce__(self) -> tuple:
        # It crosses Ray's process boundaries: rebuilt from its own arguments, not the message.
        args = (self.url, self.endpoint, self.status, self.server_message, self.hint, self.body)
        return type(self), args, self.__dict__

    @classmethod
    def from_response(cls, url: str, endpoint: str, response: HttpAnswer) -> EngineError:
        status = response.status_code
        hint = (
            "the engine rejected the request; check its fields against SGLang's API"
            if status < 500
            else "the engine failed while serving it; see the engine's log"
        )
        return cls(url, endpoint, status, server_message(response), hint, body=response.text)


def server_message(response: HttpAnswer) -> str:
    """The server's own words: SGLang answers `{"error": {"message"}}`, `{"message"}` or text."""
    text = response.text.strip()
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    message: Any = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            message = error.get("message")
        elif error is not None:
            message = error
        # FastAPI's own errors (404, HTTPException) carry `detail`.
        message = message or body.get("message") or body.get("detail")
    if message is None:
        message = text or response.reason_phrase or "(empty body)"
    message = message if isinstance(message, str) else json.dumps(message)
    return message[:_MAX_MESSAGE_CHARS]
