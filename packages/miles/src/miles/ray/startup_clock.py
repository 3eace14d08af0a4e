"""`StartupClock`: how long each phase of a run's start-up took, logged with its first rollout.

Phases may overlap (the engines load their model while the trainers build theirs), so each is its
own duration, measured where the work ran, and `startup/total_s` is the wall time from entering
the run to being ready to generate. `startup/began_at` (Unix seconds) lets a launcher add the time
before that: the interpreter's start and the driver's imports (bench/startup.py does).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StartupClock:
    def __init__(self) -> None:
        self.began_at = time.time()
        self._began = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as phase `name`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = time.perf_counter() - start

    def record(self, seconds: dict[str, float]) -> None:
        """Phases measured elsewhere (in the rollout manager, say)."""
        self.seconds.update(seconds)

    def finish(self) -> dict[str, float]:
        """The start-up's metrics, `startup/total_s` ending now."""
        return {
            "startup/began_at": self.began_at,
            **{f"startup/{name}_s": value for name, value in self.seconds.items()},
            "startup/total_s": time.perf_counter() - self._began,
        }
