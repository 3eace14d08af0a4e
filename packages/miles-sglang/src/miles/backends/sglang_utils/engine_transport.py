"""The HTTP exchange under `EngineClient`: one aiohttp connection pool per client, a deadline for the
whole call (`EngineTimeouts`) and the retry rule. Idempotent GETs are retried (bounded, exponential
backoff, on connection errors and 5xx); a POST - generation, pause, weight updates - is sent again
only when the server cannot have processed it (connection refused, or 503 with its Retry-After),
because repeating one is not harmless.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from miles.backends.sglang_utils import fast_json
from miles.backends.sglang_utils.engine_error import EngineError

logger = logging.getLogger(__name__)

# Connection-level failures: the request did not reach a live server, or the connection broke
# (connection errors, timeouts of the connect itself, a broken body). A read timeout is not among
# them: the server is alive but slow, and retrying would only multiply the wait.
_RETRYABLE_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
JSON_BODY = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Answer:
    """One whole HTTP answer, read within the call's deadline."""

    status_code: int
    reason_phrase: str
    headers: Mapping[str, str]
    content: bytes

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return fast_json.loads(self.content)

    @classmethod
    async def read(cls, response: aiohttp.ClientResponse) -> Answer:
        return cls(response.status, response.reason or "", response.headers, await response.read())


KEEPALIVE_EXPIRY_S = 2.0
"""Seconds an idle pooled connection is kept; below the servers' 5 s keep-alive timeout."""


@dataclass(frozen=True, kw_only=True)
class EngineTimeouts:
    """Seconds per kind of call; one engine serves calls that take milliseconds and hours."""

    connect_s: float = 10.0
    """Establishing a TCP connection."""
    control_s: float = 60.0
    """Health, info, cache, pause and abort calls (SGLang's /health_generate may take 20 s)."""
    generate_s: float = 3600.0
    """The whole /generate call: a long rollout streams nothing until it ends."""
    per_token_s: float | None = 1.0
    """A /generate call's deadline is this times its max_new_tokens plus the control bound,
    capped at `generate_s`: a short request to a hung engine fails in a minute, not an hour.
    None: `generate_s` for every request."""
    weights_s: float = 1800.0
    """Weight updates and memory release/resume: loading a large model takes minutes."""

    def generate_deadline_s(self, payload: dict[str, Any]) -> float:
        """The deadline of one /generate call with `payload` (SGLang's body)."""
        if self.per_token_s is None:
            return self.generate_s
        params = payload.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params]
        tokens = max(
            (int(p.get("max_new_tokens") or _SGLANG_MAX_NEW_TOKENS) for p in params if p),
            default=_SGLANG_MAX_NEW_TOKENS,
        )
        return min(self.generate_s, self.control_s + self.per_token_s * tokens)


# SGLang's default max_new_tokens, when a request leaves it out.
_SGLANG_MAX_NEW_TOKENS = 128
# The longest Retry-After a client honours; a longer one waits this long and tries again.
_MAX_RETRY_AFTER_S = 30.0


class EngineTransport:
    """The HTTP half of `EngineClient`: the connection pool of one URL, each call's deadline and
    its retries. Takes EngineClient's arguments; its methods are EngineClient's private ones.

    EngineClient subclasses it rather than holding one: its calls reach `_request` as plain method
    calls, with no extra hop on the rollout's hot path. On aiohttp: a rollout sends a /generate per
    group at once and reads the answers as they come, and aiohttp spends a fraction of httpx's time
    per call (`bench/engine_client.py`: 8 concurrent calls to a canned server, 2.4 ms a round
    against httpx's 9.4 ms on 2 cores).
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        max_concurrency: int = 256,
        timeouts: EngineTimeouts | None = None,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
    ):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency ({max_concurrency}) must be at least 1")
        if max_retries < 0:
            raise ValueError(f"max_retries ({max_retries}) must be 0 or more")
        self.url = url.rstrip("/")
        self.timeouts = timeouts or EngineTimeouts()
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        # Held by EngineClient's generation calls; the pool below has room for all of them.
        self._generation_slots = asyncio.Semaphore(max_concurrency)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._max_connections = max_concurrency + 16
        self._http: aiohttp.ClientSession | None = None
        self._http_loop: asyncio.AbstractEventLoop | None = None

    async def aclose(self) -> None:
        """Close the connection pool."""
        http, self._http = self._http, None
        if http is not None:
            await http.close()

    def _session(self) -> aiohttp.ClientSession:
        """The connection pool, opened on the running loop at the first call."""
        loop = asyncio.get_running_loop()
        if self._http is None:
            self._http = aiohttp.ClientSession(
                headers=self._headers,
                # Room for every generation slot plus the control calls that bypass the slots.
                # Idle connections expire before the server's keep-alive timeout (uvicorn's
                # default, which SGLang keeps, is 5 s): reusing one the server is closing fails a
                # /generate with a broken connection, and a non-idempotent call must not be
                # retried blindly.
                connector=aiohttp.TCPConnector(
                    limit=self._max_connections, keepalive_timeout=KEEPALIVE_EXPIRY_S
                ),
                # Engines are cluster-internal: a proxy from the environment would only get in
                # the way.
                trust_env=False,
            )
            self._http_loop = loop
        elif self._http_loop is not loop:
            raise RuntimeError(
                f"{self!r} is used from a second event loop; its connections belong to the "
                "first. Create one EngineClient per event loop (threads: SyncEngineClient)"
            )
        return self._http

    def _timeout(self, read_s: float) -> aiohttp.ClientTimeout:
        # A read bound between bytes, as SGLang's answers arrive whole after a long silence; the
        # whole call's deadline is the caller's (`_request`).
        return aiohttp.ClientTimeout(sock_read=read_s, sock_connect=self.timeouts.connect_s)

    async def _request(
        self,
        method: str,
        endpoint: str,
        *,
        payload: Any = None,
        read_timeout_s: float | None = None,
        retry: bool = False,
        deadline_s: float | None = None,
    ) -> Answer:
        """One call, whole within `deadline_s` (default: the read bound plus the connect bound),
        retries included: a server that trickles its answer cannot hold the caller. Raises
        EngineError on 4xx/5xx.

        Any method is tried again when nothing was processed: the connection was refused, or the
        server answered 503 (after its Retry-After). `retry` (idempotent calls only) also covers
        broken connections and other 5xx."""
        read_s = read_timeout_s or self.timeouts.control_s
        deadline_s = deadline_s or read_s + self.timeouts.connect_s
        try:
            async with asyncio.timeout(deadline_s):
                return await self._attempts(method, endpoint, payload, read_s, retry)
        except TimeoutError:
            raise EngineError(
                self.url, endpoint, None,
                f"timed out: no complete answer within {deadline_s:.0f} s (the call's deadline)",
                f"check that the engine at {self.url} is not hung; its log says more",
            ) from None  # fmt: skip

    async def _attempts(
        self, method: str, endpoint: str, payload: Any, read_s: float, retry: bool
    ) -> Answer:
        timeout = self._timeout(read_s)
        attempts = 1 + self.max_retries
        for attempt in range(1, attempts + 1):
            delay = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)
            try:
                response = await self._send(method, endpoint, payload, timeout)
            except aiohttp.ClientError as exc:
                failure = self._transport_error(endpoint, exc)
                # Refused: the request never left, so sending it again is safe for any method.
                unsent = isinstance(exc, aiohttp.ClientConnectorError)
                if not (unsent or (retry and _retryable(exc))):
                    raise failure from exc
            else:
                if response.is_success:
                    return response
                failure = EngineError.from_response(self.url, endpoint, response)
                status = response.status_code
                if status == 503:  # refused before any work (a full queue): honour Retry-After
                    delay = _retry_after(response) or delay
                elif status < 500 or not retry:
                    raise failure
            if attempt == attempts:
                raise failure
            logger.warning("%s; retry %d/%d in %.1f s", failure, attempt, attempts - 1, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable: the loop returns or raises")

    async def _send(
        self, method: str, endpoint: str, payload: Any, timeout: aiohttp.ClientTimeout
    ) -> Answer:
        body, headers = None, None
        if payload is not None:
            body, headers = fast_json.dumps(payload), JSON_BODY
        async with self._session().request(
            method, self.url + endpoint, data=body, headers=headers, timeout=timeout
        ) as response:
            return await Answer.read(response)

    def _transport_error(self, endpoint: str, exc: aiohttp.ClientError) -> EngineError:
        kind = "timed out" if isinstance(exc, aiohttp.ServerTimeoutError) else "connection failed"
        return EngineError(
            self.url,
            endpoint,
            None,
            f"{kind}: {type(exc).__name__}: {exc}",
            f"check that an engine is running at {self.url}",
        )


def _retryable(exc: aiohttp.ClientError) -> bool:
    # A read timeout is a connection error to aiohttp, but the server is alive and slow.
    return isinstance(exc, _RETRYABLE_ERRORS) and not isinstance(exc, aiohttp.SocketTimeoutError)


def _retry_after(response: Answer) -> float | None:
    """The seconds of a Retry-After header (HTTP dates are not used by engines), capped."""
    value = response.headers.get("retry-after", "")
    try:
        return min(max(float(value), 0.0), _MAX_RETRY_AFTER_S)
    except ValueError:
        return None
