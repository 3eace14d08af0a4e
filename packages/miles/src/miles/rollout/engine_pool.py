"""The rollout's view of its inference engines: one `generate` call, whichever engine serves it.

Without a router the pool balances on the client: each request goes to the engine with the
fewest requests this pool has in flight (ties by round robin), which keeps engines evenly busy
even when response lengths differ wildly. With a router, /generate goes to the router and it
balances. Control calls (abort, pause, flush) always go to every engine directly, because a
router does not forward them (see miles.backends.sglang_utils.router).

With fault tolerance (architecture.md: "Fault tolerance") the pool also knows which engines
serve: an engine whose request fails without an HTTP answer, or that its supervisor
(`miles.rollout.engine_supervisor`) finds dead or hung, is taken out of service. Every request
in flight on it ends at once with `EngineLostError`, which the rollout answers by sending the
request's whole group again; new requests go to the engines still serving, or wait (bounded)
until one serves again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from miles.backends.sglang_utils.client import EngineClient, EngineError, EngineTimeouts, PauseMode

logger = logging.getLogger(__name__)

# The rollout bounds concurrency itself (--rollout-concurrency); the client's own bound per
# engine only has to stay out of its way.
_CLIENT_MAX_CONCURRENCY = 1024
# After a request to an engine failed without an answer, how long its /health may take to show
# that the engine itself is alive.
_PROBE_AFTER_FAILURE_S = 5.0


class EngineLostError(RuntimeError):
    """The engine serving a request died or hung and left service; send the request again."""

    def __init__(self, url: str, reason: str):
        self.url = url
        self.reason = reason
        super().__init__(f"engine {url} left service: {reason}")

    def __reduce__(self) -> tuple:  # rebuilt from its arguments across Ray's boundaries
        return type(self), (self.url, self.reason), self.__dict__


class EngineUnavailableError(RuntimeError):
    """No engine can serve: every one is out of service past the bound, or recovery gave up."""


class EnginePool:
    """Fronts one or more engines speaking SGLang's HTTP API.

    Use it from one event loop (its clients bind their connection pools to the loop that first
    uses them); `aclose()` when done, or `async with`.
    """

    def __init__(
        self,
        engine_urls: list[str],
        *,
        router_url: str | None = None,
        timeout_s: float = 600.0,
        per_token_s: float | None = None,
        control_timeout_s: float = 60.0,
        weights_timeout_s: float = 1800.0,
        fault_tolerant: bool = False,
        api_key: str | None = None,
        lora_name: str | None = None,
    ):
        """`timeout_s` bounds each /generate answer (`per_token_s`: sooner for short requests,
        `EngineTimeouts`), and with `fault_tolerant` also the wait for an engine to serve again;
        `control_timeout_s` / `weights_timeout_s` bound control and memory calls;
        `api_key`: the engines' admin key, sent on every call (it also
        opens their inference routes); `lora_name`: the LoRA adapter every request runs with
        (SGLang's `lora_path`) unless it names its own, for engines that serve the trained
        adapter beside the base."""
        if not engine_urls:
            raise ValueError(
                "EnginePool needs at least one engine URL (control calls go to every engine, "
                "also behind a router); got none"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) must be positive")
        if len({url.rstrip("/") for url in engine_urls}) != len(engine_urls):
            raise ValueError(f"engine URLs must be distinct, got {engine_urls}")
        self.timeout_s = timeout_s
        self.fault_tolerant = fault_tolerant
        self.lora_name = lora_name
        timeouts = EngineTimeouts(
            generate_s=timeout_s, per_token_s=per_token_s, control_s=control_timeout_s,
            weights_s=weights_timeout_s,
        )  # fmt: skip
        self._engines = {
            url.rstrip("/"): EngineClient(
                url, api_key=api_key, max_concurrency=_CLIENT_MAX_CONCURRENCY, timeouts=timeouts
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
        # Service state: which engines serve; each serving spell has its own "lost" event, which
        # ends the requests sent to it during that spell.
        self._serving: dict[str, asyncio.Event] = {url: asyncio.Event() for url in self._engines}
        self._lost_reasons: dict[str, str] = {}
        self._serving_changed = asyncio.Event()
        self._failure: BaseException | None = None
        self.on_lost: Callable[[str, str], None] | None = None
        """Called with (url, reason) when an engine leaves service (the supervisor's hook)."""
        self.reissued_requests = 0
        """Requests that ended with EngineLostError (each is sent again by its rollout)."""

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

    def _pick(self) -> str | None:
        """The least-loaded serving target; among equals, the first at or after the round-robin
        cursor. None when nothing serves (behind a router: no engine serves)."""
        if self._router is not None:
            return self._router.url if self._serving else None
        urls = list(self._in_flight)
        loads = {url: load for url, load in self._in_flight.items() if url in self._serving}
        if not loads:
            return None
        least = min(loads.values())
        for step in range(len(urls)):
            position = (self._next + step) % len(urls)
            if loads.get(urls[position]) == least:
                self._next = position + 1
                return urls[position]
        raise AssertionError("unreachable: some serving target has the least load")

    async def _pick_serving(self) -> str:
        """`_pick`, waiting up to `timeout_s` while every engine is out of service."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self._failure is not None:
                raise self._failure
            target = self._pick()
            if target is not None:
                return target
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineUnavailableError(
                    f"no engine served for {self.timeout_s:.0f} s (--rollout-request-timeout-s); "
                    f"out of service: {self._lost_reasons}"
                )
            changed = self._serving_changed
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                continue

    async def generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST /generate `payload` (SGLang's body) to one engine; returns SGLang's answer.

        With fault tolerance, raises `EngineLostError` when the engine leaves service before it
        answers (the caller sends the request again)."""
        if self.lora_name is not None and payload.get("lora_path") is None:
            payload = {**payload, "lora_path": self.lora_name}
        target = await self._pick_serving()
        # Picking and counting happen with no await in between, so concurrent callers see each
        # other's choices.
        client = self._router or self._engines[target]
        self._in_flight[target] += 1
        try:
            if not self.fault_tolerant:
                return await client.generate(payload)  # type: ignore[return-value]
            return await self._generate_while_serving(target, client.generate(payload))
        finally:
            self._in_flight[target] -= 1

    async def _generate_while_serving(self, target: str, request: Awaitable[Any]) -> Any:
        """`request`, ended with EngineLostError when its engine leaves service first."""
        # Behind a router the serving engine is unknown: a failed request is lost, and the
        # supervisor's health checks take the dead engine out of the router.
        lost = self._serving.get(target) if self._router is None else None
        answer = asyncio.ensure_future(request)
        waiters: set[asyncio.Future[Any]] = {answer}
        if lost is not None:
            waiters.add(asyncio.ensure_future(lost.wait()))
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters - {answer}:
                waiter.cancel()
            if not answer.done():
                answer.cancel()
                await asyncio.gather(answer, return_exceptions=True)
        if answer.cancelled():
            self.reissued_requests += 1
            raise EngineLostError(target, self._lost_reasons.get(target, "left service"))
        try:
            return answer.result()
        except EngineError as err:
            if err.status is not None:
                raise  # the engine answered: a refused request is the sender's problem
            # A broken connection may be the connection's fault alone: an engine that still
            # answers /health keeps serving, and only this request is sent again.
            probe_s = min(_PROBE_AFTER_FAILURE_S, self.timeout_s)
            if self._router is None and not (await self.check_health(target, probe_s))[0]:
                self.mark_lost(target, str(err))
            self.reissued_requests += 1
            raise EngineLostError(target, str(err)) from err

    async def check_health(self, url: str, timeout_s: float) -> tuple[bool, str]:
        """Engine `url`'s /health within `timeout_s`: (answered 2xx, its answer or why not)."""
        return await self._engines[url.rstrip("/")].check_health(timeout_s)

    # -- service state (fault tolerance) -------------------------------------------------------

    def serving(self) -> list[str]:
        """The engines in service."""
        return [url for url in self._engines if url in self._serving]

    def mark_lost(self, url: str, reason: str) -> None:
        """Take engine `url` out of service: its requests in flight end with EngineLostError
        and `on_lost` is told. A no-op for an engine already out of service."""
        url = url.rstrip("/")
        event = self._serving.pop(url, None)
        if event is None:
            return
        self._lost_reasons[url] = reason
        logger.warning("engine %s left service: %s", url, reason)
        event.set()
        if self.on_lost is not None:
            self.on_lost(url, reason)

    def admit(self, url: str) -> None:
        """Put engine `url` back in service (it runs the current weights)."""
        url = url.rstrip("/")
        if url not in self._engines:
            raise ValueError(f"{url} is not an engine of this pool: {list(self._engines)}")
        if url in self._serving:
            return
        self._serving[url] = asyncio.Event()
        self._lost_reasons.pop(url, None)
        self._notify()
        logger.info("engine %s is back in service", url)

    def fail(self, error: BaseException) -> None:
        """Give up: every waiting and later `generate` raises `error`."""
        self._failure = error
        for url in list(self._serving):
            self.mark_lost(url, str(error))
        self._notify()

    def _notify(self) -> None:
        changed, self._serving_changed = self._serving_changed, asyncio.Event()
        changed.set()

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per engine URL (per router URL when a router balances)."""
        return dict(self._in_flight)

    async def _broadcast(self, what: str, **kwargs: Any) -> dict[str, Any]:
        """`what(**kwargs)` on every serving engine; their answers by URL. With fault tolerance
        an engine that does not answer leaves service instead of failing the call."""
        # Engines out of service are being restarted: nothing of theirs is left to control.
        urls = self.serving()
        calls = (getattr(self._engines[url], what)(**kwargs) for url in urls)
        answers = await asyncio.gather(*calls, return_exceptions=self.fault_tolerant)
        for url, answer in zip(urls, answers, strict=True):
            if isinstance(answer, EngineError) and answer.status is None:
                self.mark_lost(url, str(answer))
            elif isinstance(answer, BaseException):
                raise answer
        return {url: a for url, a in zip(urls, answers, strict=True) if url in self._serving}

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
            for url, answer in answers.items()
            if not answer.get("success", False)
        ]
        if failed:
            raise RuntimeError(f"/{what} failed on {len(failed)} engine(s): " + "; ".join(failed))

    async def aclose(self) -> None:
        """Close every connection pool."""
        clients = [*self._engines.values(), *([self._router] if self._router else [])]
        await asyncio.gather(*(client.aclose() for client in clients))
