"""Engine fault tolerance: health checks, restarts, and the way back into service.

(architecture.md: "Fault tolerance")

`EngineSupervisor` watches the engines of one `EnginePool`. Every `interval_s` it asks each serving
engine's /health, bounded by `timeout_s`; an engine that does not answer in time (dead, or hung)
leaves service, and so does one whose request failed without an HTTP answer (the pool reports it).
A lost engine is restarted by the `restart` callable (the rollout manager's: same bundle, same
port, so its URL stays), then waits for the current weights: the trainers push them, the rollout
manager calls `admit`, and the engine serves again. An engine lost more than `max_restarts` times
stops the run: the pool fails with `EngineUnavailableError`, naming the engine, its last failure
and the end of its log. Engines the run did not launch (no `restart`) are never restarted: a lost
one stays out of service for good, and the run goes on with the others while any serves.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from miles.rollout.engine_pool import EnginePool, EngineUnavailableError

logger = logging.getLogger(__name__)


class EngineState(enum.Enum):
    SERVING = "serving"
    RESTARTING = "restarting"
    AWAITING_WEIGHTS = "awaiting_weights"  # restarted, still on the checkpoint's weights
    FAILED = "failed"
    LOST = "lost"  # an external engine that stopped answering: not the run's to restart


@dataclass(frozen=True, kw_only=True)
class FaultToleranceConfig:
    interval_s: float
    """Seconds between two health checks of a serving engine."""
    timeout_s: float
    """An engine whose /health does not answer within this is hung."""
    max_restarts: int
    """Restarts per engine before the run stops."""
    needs_weights: bool
    """A restarted engine serves only after `admit` (trainers hold newer weights than the
    checkpoint it loads); False for runs that never update weights."""


class EngineSupervisor:
    """Keeps the pool's engines serving; all methods run on the pool's event loop."""

    def __init__(
        self,
        pool: EnginePool,
        config: FaultToleranceConfig,
        *,
        restart: Callable[[int], Awaitable[None]] | None,
        log_tail: Callable[[int], str],
        on_remove: Callable[[str], Awaitable[None]] | None = None,
        on_return: Callable[[str], Awaitable[None]] | None = None,
    ):
        """`restart(index)` stops engine `index` (whatever is left of it) and starts it again at
        its URL, raising if it does not come up; None for engines the run did not launch (a lost
        one stays lost); `log_tail(index)` is the end of its log;
        `on_remove` / `on_return` take a URL out of and back into a router."""
        self.pool = pool
        self.config = config
        self.urls = list(pool.engine_urls)
        self._restart = restart
        self._log_tail = log_tail
        self._on_remove = on_remove
        self._on_return = on_return
        self.states = dict.fromkeys(self.urls, EngineState.SERVING)
        self.restarts = dict.fromkeys(self.urls, 0)
        self.seconds_lost = 0.0
        self._lost_at: dict[str, float] = {}
        self._checker: asyncio.Task[None] | None = None
        self._recoveries: dict[str, asyncio.Task[None]] = {}
        self._restarted = asyncio.Event()
        self._restarted.set()  # nothing is restarting
        self._given_up = False
        pool.on_lost = self._on_lost

    def start(self) -> None:
        """Begin the periodic health checks (call from the pool's event loop)."""
        if self._checker is None:
            self._checker = asyncio.create_task(self._check_forever())

    async def stop(self) -> None:
        tasks = [t for t in (self._checker, *self._recoveries.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._checker = None
        self._recoveries = {}

    # -- detection --------------------------------------------------------------------------

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            await self.check_now()

    async def check_now(self) -> list[str]:
        """One health check of every serving engine; the engines found dead or hung."""
        serving = [url for url in self.urls if self.states[url] is EngineState.SERVING]
        answers = await asyncio.gather(
            *(self.pool.check_health(url, self.config.timeout_s) for url in serving)
        )
        lost = []
        for url, (ok, answer) in zip(serving, answers, strict=True):
            if not ok and self.states[url] is EngineState.SERVING:
                lost.append(url)
                # The probe's own words: a refused or reset connection, an HTTP error, or
                # no complete answer within the timeout.
                self.pool.mark_lost(url, f"/health failed: {answer}")
        return lost

    def _on_lost(self, url: str, reason: str) -> None:
        if self._given_up or self.states.get(url) is not EngineState.SERVING:
            return
        if self._restart is None:
            self._lose_for_good(url, reason)
            return
        self.states[url] = EngineState.RESTARTING
        self._lost_at[url] = time.monotonic()
        self._restarted.clear()
        self._recoveries[url] = asyncio.get_running_loop().create_task(self._recover(url, reason))

    def _lose_for_good(self, url: str, reason: str) -> None:
        """An external engine: out of service (and out of the router) for the rest of the run."""
        self.states[url] = EngineState.LOST
        serving = [u for u in self.urls if self.states[u] is EngineState.SERVING]
        logger.warning(
            "external engine %d at %s is lost (%s); the run did not launch it, so it is not "
            "restarted: going on with %d engine(s) %s", self.urls.index(url), url, reason,
            len(serving), serving,
        )  # fmt: skip
        if self._on_remove is not None:
            remove = self._on_remove(url)
            self._recoveries[url] = asyncio.get_running_loop().create_task(remove)
        if not serving:
            self._given_up = True
            self.pool.fail(
                EngineUnavailableError(
                    f"every external engine is lost (the last, {url}: {reason}); the run cannot "
                    "restart engines it did not launch: start them again and resume from the "
                    "last checkpoint"
                )
            )

    def lost_for_good(self) -> list[str]:
        """External engines lost during the run (never back in service)."""
        return [url for url in self.urls if self.states[url] is EngineState.LOST]

    # -- recovery -----------------------------------------------------------------------------

    async def _recover(self, url: str, reason: str) -> None:
        index = self.urls.index(url)
        if self._on_remove is not None:
            try:
                await self._on_remove(url)
            except Exception:
                logger.exception("could not take engine %s out of the router", url)
        while True:
            if self.restarts[url] >= self.config.max_restarts:
                self._give_up(index, reason)
                return
            self.restarts[url] += 1
            logger.warning("restarting engine %d at %s (restart %d of at most %d): %s",
                           index, url, self.restarts[url], self.config.max_restarts, reason)  # fmt: skip
            try:
                await self._restart(index)
            except Exception as err:
                logger.exception("engine %d at %s did not restart", index, url)
                reason = f"restart failed: {err}"
                continue
            break
        self.states[url] = EngineState.AWAITING_WEIGHTS
        self._notify_restarted()
        if not self.config.needs_weights:
            await self.admit([url])

    def _give_up(self, index: int, reason: str) -> None:
        url = self.urls[index]
        self.states[url] = EngineState.FAILED
        self._given_up = True  # the run stops: the other engines are not restarted any more
        self._notify_restarted()
        self.pool.fail(
            EngineUnavailableError(
                f"engine {index} at {url} failed again after {self.restarts[url]} restart(s) "
                f"(--max-engine-restarts {self.config.max_restarts}): {reason}; the end of its "
                f"log:\n{self._log_tail(index)}"
            )
        )

    def _notify_restarted(self) -> None:
        if not any(state is EngineState.RESTARTING for state in self.states.values()):
            self._restarted.set()

    def awaiting_weights(self) -> list[str]:
        """Restarted engines that serve once they hold the current weights."""
        return [url for url in self.urls if self.states[url] is EngineState.AWAITING_WEIGHTS]

    async def wait_restarted(self, timeout_s: float) -> list[str]:
        """Wait until no engine is restarting; the engines then awaiting weights."""
        try:
            await asyncio.wait_for(self._restarted.wait(), timeout_s)
        except TimeoutError:
            restarting = [u for u, s in self.states.items() if s is EngineState.RESTARTING]
            raise EngineUnavailableError(
                f"engines {restarting} did not restart within {timeout_s:.0f} s "
                "(--engine-startup-timeout-s)"
            ) from None
        failed = [url for url, state in self.states.items() if state is EngineState.FAILED]
        if failed:
            raise EngineUnavailableError(f"engines {failed} failed for good; see the run's log")
        return self.awaiting_weights()

    async def admit(self, urls: list[str]) -> None:
        """Put restarted engines back in service (they now hold the current weights)."""
        for url in urls:
            if self.states.get(url) is not EngineState.AWAITING_WEIGHTS:
                raise ValueError(
                    f"engine {url} is {self.states.get(url)}, not awaiting weights: only a "
                    "restarted engine is admitted"
                )
            if self._on_return is not None:
                await self._on_return(url)
            self.states[url] = EngineState.SERVING
            self.seconds_lost += time.monotonic() - self._lost_at.pop(url)
            self.pool.admit(url)

    def metrics(self) -> dict[str, float]:
        """Restarts so far, requests sent again, seconds engines spent out of service, the
        engines serving now, and the external engines lost for good."""
        now = time.monotonic()
        down = sum(now - lost_at for lost_at in self._lost_at.values())
        return {
            "engine/serving": float(len(self.pool.serving())),
            "engine/restarts": float(sum(self.restarts.values())),
            "engine/reissued_requests": float(self.pool.reissued_requests),
            "engine/seconds_lost": self.seconds_lost + down,
            "engine/lost_for_good": float(len(self.lost_for_good())),
        }
