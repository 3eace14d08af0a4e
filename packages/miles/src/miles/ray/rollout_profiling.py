"""Profiling the rollout side of a run (--profile-target rollout-manager / engine), driven from the
rollout manager's process, which owns the engines and knows its own pid.

The manager is sampled by py-spy (its Python stacks: the asyncio loop, rewards, train data); each
engine runs its own profiler (SGLang's /start_profile, which the reference engine serves too), so
its trace is the engine's view of the same window, GPU kernels included on SGLang. Traces go to
`<dir>/rollout_manager/` and `<dir>/engines/engine_<i>/`.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from miles.backends.sglang_utils.client import EngineClient
from miles.utils.observability.py_spy import PySpyRecording


class RolloutProfiling:
    """One profiling window of the manager and its engines: `start`, then `stop`."""

    def __init__(self, targets: list[str], out_dir: str, label: str) -> None:
        self.targets = targets
        self.out_dir = Path(out_dir)
        self.label = label
        self._py_spy: PySpyRecording | None = None
        self._engine_dirs: dict[str, Path] = {}

    async def start(self, engine_urls: list[str], admin_key: str) -> None:
        if "rollout-manager" in self.targets:
            path = self.out_dir / "rollout_manager" / f"{self.label}.json"
            self._py_spy = await asyncio.to_thread(PySpyRecording, os.getpid(), path)
        if "engine" in self.targets:
            self._engine_dirs = {
                url: self.out_dir / "engines" / f"engine_{index}"
                for index, url in enumerate(engine_urls)
            }
            await self._each_engine(admin_key, "start_profile")

    async def stop(self, admin_key: str) -> list[str]:
        """End the window; the trace files and engine trace folders written."""
        written = []
        if self._engine_dirs:
            await self._each_engine(admin_key, "stop_profile")
            written += [str(d) for d in self._engine_dirs.values()]
        if self._py_spy is not None:
            written.append(str(await asyncio.to_thread(self._py_spy.stop)))
        return written

    async def _each_engine(self, admin_key: str, call: str) -> None:
        async def one(url: str, out: Path) -> None:
            async with EngineClient(url, api_key=admin_key, max_retries=0) as client:
                args = (str(out),) if call == "start_profile" else ()
                answer = await getattr(client, call)(*args)
            if not answer.get("success", False):
                raise RuntimeError(f"engine {url} refused /{call}: {answer.get('message')}")

        await asyncio.gather(*(one(url, out) for url, out in self._engine_dirs.items()))
