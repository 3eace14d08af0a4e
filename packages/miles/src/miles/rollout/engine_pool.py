"""The rollout's view of its inference engines: one `generate` call, whichever engine serves it.

Without a router the pool balances on the client: each request goes to the engine with the
fewest requests this pool has in flight (ties by round robin), which keeps engines evenly busy
even when response lengths differ wildly. With a router, /generate goes to the router and it
balances. Control calls (abort, pause, flush) always go to every engine directly, because a
router does not forward them (see miles.backends.sglang_utils.router).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from miles.backends.sglang_utils.client import EngineClient, EngineTimeouts, PauseMode

logger = logging.getLogger(__name__)

# The rollout bounds concurrency itself (--rollout-concurrency); the client's own bound per
# engine only has to stay out of its way.
_CLIENT_MAX_CONCURRENCY = 1024


class EnginePool:
    """Fronts one or more engines speaking SGLang's HTTP API.

    Use it from one event loop (its clients bind their connection pools to the loop that first
    uses them); `aclose()` when done, or `async with`.
    """

    def __init__(
        self, engine_urls: list[str], *, router_url: str | None = None, timeout_s: float = 600.0
    ):
        if not engine_urls:
            raise ValueError(
                "EnginePool needs at least one engine URL (control calls go to every engine, "
                "also behind a router); got none"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) must be positive")
        if len({url.rstrip("/") for url in engine_urls}) != len(engine_urls):
            raise ValueError(f"engine URLs must be distinct, got {engine_urls}")
        timeouts = EngineTimeouts(generate_s=timeout_s)
        self._engines = {
            url.rstrip("/"): EngineClient(
                url, max_concurrency=_CLIENT_MAX_CONCURRENCY, timeouts=timeouts
            )
            for url in engine_urls
        }
        self._router = (
            EngineClient(router_url, max_concurrency=_CLIENT_MAX_CONCURRENCY, timeouts=timeouts)
            if router_url
            else None
        )
        # Requests in flight per generate target (the engines, or the router alone).
        targets = [self._router.url] if self._router else list(self._engines)
        self._in_flight = dict.fromkeys(targets, 0)
        self._next = 0  # round-robin position among equally loaded engines

    def __repr__(self) -> str:
        router = f", router_url={self._router.url!r}" if self._router else ""
        return f"EnginePool({list(self._engines)!r}{router})"

    @property
    def engine_urls(self) -> list[str]:
        return list(self._engines)

    @property
    def router_url(self) -> str | None:
        return self._router.url if self._router else None

    async def __aenter__(self) -> EnginePool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _pick(self) -> str:
        """The least-loaded target; among equals, the first at or after the round-robin cursor."""
        urls = list(self._in_flight)
        least = min(self._in_flight.values())
        for step in range(len(urls)):
            position = (self._next + step) % len(urls)
            if self._in_flight[urls[position]] == least:
                self._next = position + 1
                return urls[position]
        raise AssertionError("unreachable: some target has the least load")

    async def generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST /generate `payload` (SGLang's body) to one engine; returns SGLang's answer."""
        # Picking and counting happen with no await in between, so concurrent callers see each
        # other's choices.
        url = self._pick()
        client = self._router or self._engines[url]
        self._in_flight[url] += 1
        try:
            return await client.generate(payload)  # type: ignore[return-value]
        finally:
            self._in_flight[url] -= 1

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per engine URL (per router URL when a router balances)."""
        return dict(self._in_flight)

    async def _broadcast(self, what: str, **kwargs: Any) -> list[Any]:
        clients = list(self._engines.values())
        return await asyncio.gather(*(getattr(client, what)(**kwargs) for client in clients))

    async def abort_all(self) -> None:
        """Abort every request running or queued on every engine (they answer finish 'abort')."""
        await self._broadcast("abort_request", abort_all=True)

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Pause every engine; SGLang's `mode` says what happens to running requests."""
        await self._broadcast("pause_generation", mode=mode)

    async def continue_generation(self) -> None:
        """Resume every engine after `pause_generation`."""
        await self._broadcast("continue_generation")

    async def flush_cache(self) -> None:
        """Flush every engine's cache."""
        await self._broadcast("flush_cache")

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free every engine's device memory (`tags`: weights, kv_cache; None: all), e.g. for a
        colocated trainer. Raises if an engine refuses (requests still running)."""
        await self._broadcast_update("release_memory_occupation", tags=tags)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Take back what `release_memory_occupation` freed, on every engine."""
        await self._broadcast_update("resume_memory_occupation", tags=tags)

    async def _broadcast_update(self, what: str, **kwargs: Any) -> None:
        # SGLang answers a refused update with `success: false` (not an HTTP error): check it,
        # or a colocated trainer would start on memory an engine still holds.
        answers = await self._broadcast(what, **kwargs)
        failed = [
            f"{url}: {answer.get('message') or '(no message)'}"
            for url, answer in zip(self._engines, answers, strict=True)
            if not answer.get("success", False)
        ]
        if failed:
            raise RuntimeError(f"/{what} failed on {len(failed)} engine(s): " + "; ".join(failed))

    async def aclose(self) -> None:
        """Close every connection pool."""
        clients = [*self._engines.values(), *([self._router] if self._router else [])]
        await asyncio.gather(*(client.aclose() for client in clients))
