"""The agents' endpoint: an OpenAI-compatible HTTP server with one base URL per session,

    http://HOST:PORT/sessions/<session id>/v1     POST chat/completions, GET models

served in the rollout manager's own event loop, so a session reaches the engines through the
rollout's engine pool (the router or the engines themselves). Any OpenAI client, in the rollout's
process or another on the machine (--session-server-host), can drive a session; what it sends
becomes a token-exact trajectory (`AgentSession`). Streaming is answered as server-sent events
once the turn is done: a session records whole turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse

from miles.backends.sglang_utils.reference_engine.errors import InvalidRequestError
from miles.backends.sglang_utils.reference_engine.openai_protocol import (
    ChatCompletionBody,
    Server,
    now,
    validate,
)
from miles.backends.sglang_utils.reference_engine.serving import json_body
from miles.rollout.agent_session import AgentSession, SessionError

logger = logging.getLogger(__name__)

# Images are read where the run's model reads them: a session without a processor refuses them.
_SESSIONS = Server("a miles agent session", "leave it unset", reads_images=True)
_MAX_REQUEST_BYTES = 64 << 20


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # The process's signals belong to the rollout manager, not to this server.
        yield


class SessionServer:
    """The HTTP server and the sessions open on it."""

    def __init__(self, host: str = "127.0.0.1", model_name: str = "miles-policy") -> None:
        self.host, self.model_name = host, model_name
        self.sessions: dict[str, AgentSession] = {}
        self._server: _QuietServer | None = None
        self._task: asyncio.Task | None = None
        self.port: int | None = None

    async def start(self) -> SessionServer:
        """Listen on a free port of `host`; returns once the server accepts connections."""
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, 0))
        except OSError as err:
            sock.close()
            raise OSError(
                f"the agents' session server cannot listen on {self.host!r} "
                f"(--session-server-host): {err}"
            ) from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(_app(self), log_level="warning", access_log=False, lifespan="off")
        self._server = _QuietServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                await self._task  # raises what stopped it
                raise RuntimeError("the agents' session server stopped while starting")
            await asyncio.sleep(0.01)
        logger.info("agent sessions are served at %s", self.url)
        return self

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def open(self, session: AgentSession) -> str:
        """Serve `session`; its base URL (what an OpenAI client takes as base_url)."""
        self.sessions[session.id] = session
        return f"{self.url}/sessions/{session.id}/v1"

    async def close(self, session: AgentSession) -> None:
        self.sessions.pop(session.id, None)
        await session.close()

    async def aclose(self) -> None:
        for session in list(self.sessions.values()):
            await self.close(session)
        if self._server is not None:
            self._server.should_exit = True
            await self._task
            self._server = self._task = None


def _app(server: SessionServer) -> FastAPI:
    app = FastAPI(title="miles agent sessions")

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, err: InvalidRequestError):
        error = {"message": str(err), "type": "invalid_request_error", "param": err.param,
                 "code": None}  # fmt: skip
        return JSONResponse({"error": error}, status_code=400)

    @app.exception_handler(SessionError)
    async def session_error(request: Request, err: SessionError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        what = {404: "no such route", 405: "method not allowed"}.get(err.status_code, err.detail)
        error = {"message": f"{request.method} {request.url.path}: {what}; a session serves "
                 "POST /sessions/<id>/v1/chat/completions and GET /sessions/<id>/v1/models",
                 "type": "invalid_request_error", "param": None, "code": None}  # fmt: skip
        return JSONResponse({"error": error}, status_code=err.status_code)

    def session_of(session_id: str) -> AgentSession:
        session = server.sessions.get(session_id)
        if session is None:
            raise SessionError(404, f"no open session {session_id!r}", "session_not_found")
        return session

    @app.get("/sessions/{session_id}/v1/models")
    async def models(session_id: str):
        session_of(session_id)
        card = {"id": server.model_name, "object": "model", "created": now(), "owned_by": "miles"}
        return {"object": "list", "data": [card]}

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def chat_completions(session_id: str, request: Request):
        session = session_of(session_id)
        body = validate(ChatCompletionBody, await json_body(request, _MAX_REQUEST_BYTES), _SESSIONS)
        answer = await session.chat_completion(body)
        if body.stream:
            return StreamingResponse(
                _events(answer, body.include_usage), media_type="text/event-stream"
            )
        return answer

    return app


async def _events(answer: dict[str, Any], include_usage: bool) -> AsyncIterator[bytes]:
    """A finished answer as the chunks a stream of it would have sent, then `[DONE]`."""
    choice = answer["choices"][0]
    message = choice["message"]
    envelope = {k: answer[k] for k in ("id", "created", "model")} | {
        "object": "chat.completion.chunk"
    }

    def chunk(delta: dict[str, Any], **fields: Any) -> bytes:
        event = {**envelope, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": None, **fields}]}  # fmt: skip
        return f"data: {json.dumps(event)}\n\n".encode()

    yield chunk({"role": "assistant", "content": ""})
    if message["content"] or choice["logprobs"]:
        yield chunk({"content": message["content"]}, logprobs=choice["logprobs"])
    if message["tool_calls"]:
        calls = [{**call, "index": k} for k, call in enumerate(message["tool_calls"])]
        yield chunk({"tool_calls": calls})
    ids = {k: choice[k] for k in ("prompt_token_ids", "token_ids") if k in choice}
    yield chunk(
        {}, finish_reason=choice["finish_reason"], matched_stop=choice["matched_stop"], **ids
    )
    if include_usage:
        event = {**envelope, "choices": [], "usage": answer["usage"]}
        yield f"data: {json.dumps(event)}\n\n".encode()
    yield b"data: [DONE]\n\n"
