"""`--rm-type remote`: a reward model served over HTTP at `--rm-url`.

Wire format: POST `{"prompt", "response", "label", "metadata"}` (with `--group-rm`, a JSON list of
them, one per sample of the group); the answer is a number or a dict holding the reward (the hub
reads it), or with `--group-rm` a list of those. Connection errors and 5xx are retried with
exponential backoff up to `--rm-max-retries` times; a 4xx is the server rejecting the request, so it
fails at once with the server's message. The overall deadline (`--rm-timeout-s`) is the hub's.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx

from miles.backends.sglang_utils.client import server_message
from miles.backends.training_utils.batching.sample import Sample

logger = logging.getLogger(__name__)

# The request did not reach a live server, or the connection broke mid-way. A read timeout is not
# among them: the server is alive but slow, and asking again would only multiply the wait.
_RETRYABLE_ERRORS = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)


class RemoteRewardError(RuntimeError):
    """The reward server rejected a request, failed, or was unreachable: URL, status, message."""

    def __init__(self, url: str, status: int | None, message: str, attempts: int):
        self.url = url
        self.status = status
        self.server_message = message
        self.attempts = attempts
        what = f"HTTP {status}" if status is not None else "no HTTP answer"
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        super().__init__(f"reward server {url} failed ({what}){tries}: {message}")

    def __reduce__(self) -> tuple:  # rebuilt from its arguments across Ray's boundaries
        args = (self.url, self.status, self.server_message, self.attempts)
        return type(self), args, self.__dict__


def sample_payload(sample: Sample) -> dict[str, Any]:
    """The JSON object sent for one sample."""
    return {
        "prompt": sample.prompt,
        "response": sample.response,
        "label": sample.label,
        "metadata": sample.metadata,
    }


class RemoteRewardModel:
    """Async client of one reward server; a callable the hub treats like any reward function.

    `await model(sample)` scores one sample, `await model.score_group(samples)` one batch. The
    connection pool is bound to the event loop that first uses it and rebuilt if the loop changes
    (a caller running `asyncio.run` once per rollout gets a fresh pool each time).
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        max_retries: int,
        max_connections: int,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
    ):
        self.url = url
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.max_connections = max_connections
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._http: httpx.AsyncClient | None = None
        self._http_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"RemoteRewardModel({self.url!r})"

    async def __call__(self, sample: Sample) -> Any:
        return await self._post(sample_payload(sample))

    async def score_group(self, samples: list[Sample]) -> Any:
        """One request for the whole group: a JSON list in, a JSON list expected back."""
        return await self._post([sample_payload(sample) for sample in samples])

    async def aclose(self) -> None:
        """Close the connection pool (if the loop that made it is still running)."""
        http, self._http = self._http, None
        if http is not None and self._http_loop is asyncio.get_running_loop():
            await http.aclose()

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop:
            # A pool from a finished loop cannot be closed from this one: it is dropped.
            self._http = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s),
                limits=httpx.Limits(max_connections=self.max_connections),
                # Reward servers are cluster-internal: a proxy from the environment only hurts.
                trust_env=False,
            )
            self._http_loop = loop
        return self._http

    async def _post(self, payload: Any) -> Any:
        # Metadata is free-form: anything JSON cannot encode is sent as its str().
        content = json.dumps(payload, default=str).encode()
        headers = {"Content-Type": "application/json"}
        attempts = 1 + self.max_retries
        for attempt in range(1, attempts + 1):
            try:
                response = await self._client().post(self.url, content=content, headers=headers)
            except _RETRYABLE_ERRORS as exc:
                failure = RemoteRewardError(self.url, None, f"{type(exc).__name__}: {exc}", attempt)
            except httpx.TransportError as exc:
                raise RemoteRewardError(
                    self.url, None, f"{type(exc).__name__}: {exc}", attempt
                ) from exc
            else:
                if response.is_success:
                    return self._decode(response, attempt)
                failure = RemoteRewardError(
                    self.url, response.status_code, server_message(response), attempt
                )
                if response.status_code < 500:
                    raise failure
            if attempt < attempts:
                delay = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)
                logger.debug("reward server %s: %s; retry in %.1f s", self.url, failure, delay)
                await asyncio.sleep(delay)
        raise failure

    def _decode(self, response: httpx.Response, attempt: int) -> Any:
        try:
            return response.json()
        except ValueError:
            raise RemoteRewardError(
                self.url,
                response.status_code,
                f"answer is not JSON: {response.text[:200]!r}",
                attempt,
            ) from None
