"""SGLang's profiling routes of the reference engine: `POST /start_profile` (`output_dir`,
`activities`, `with_stack`, `record_shapes`) starts torch.profiler on the engine loop's thread, and
`POST /stop_profile` writes the trace as SGLang does, `<output_dir>/<profile_id>-TP-0.trace.json.gz`
(Chrome trace events; Perfetto and TensorBoard open it). They are admin routes (`guard.py`): the
trace is written where the caller says.

SGLang's step-counted fields (`start_step`, `num_steps`) are refused by name: this engine profiles
from start to stop only.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from miles.backends.sglang_utils.reference_engine.errors import InvalidRequestError
from miles.backends.sglang_utils.reference_engine.request_models import (
    StartProfileBody,
    validate_body,
)
from miles.backends.sglang_utils.reference_engine.serving import json_body

if TYPE_CHECKING:
    from miles.backends.sglang_utils.reference_engine.engine import ReferenceEngine


class EngineProfiler:
    """One torch.profiler trace at a time, run on the engine loop's thread (where the model
    runs; the loop calls `start` and `stop` between two of its steps)."""

    def __init__(self) -> None:
        self._profiler: Any = None
        self._path: Path | None = None

    def start(self, body: StartProfileBody, cuda: bool) -> str:
        import torch

        if self._profiler is not None:
            raise InvalidRequestError("a profile is already running: POST /stop_profile first")
        kinds = {"CPU": torch.profiler.ProfilerActivity.CPU}
        if cuda:
            kinds["GPU"] = torch.profiler.ProfilerActivity.CUDA
        unknown = sorted(set(body.activities) - {"CPU", "GPU"})
        if unknown:
            raise InvalidRequestError(f"activities {unknown}: this engine records CPU and GPU")
        output_dir = Path(body.output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or "/tmp")
        output_dir.mkdir(parents=True, exist_ok=True)
        self._path = output_dir / f"{time.time()}-TP-0.trace.json.gz"
        activities = [kinds[a] for a in body.activities if a in kinds]
        self._profiler = torch.profiler.profile(
            activities=activities, with_stack=body.with_stack, record_shapes=body.record_shapes
        )
        self._profiler.start()
        return f"Start profiling. The trace goes to {self._path} at /stop_profile."

    def stop(self) -> str:
        if self._profiler is None or self._path is None:
            raise InvalidRequestError("no profile is running: POST /start_profile first")
        profiler, path, self._profiler, self._path = self._profiler, self._path, None, None
        profiler.stop()
        profiler.export_chrome_trace(str(path))  # gzipped: the name ends in .gz
        return f"Stop profiling. Trace written to {path}"


def add_profile_routes(app: FastAPI, engine: ReferenceEngine) -> None:
    """/start_profile and /stop_profile on `app`, answered by `engine`'s profiler."""
    profiler = EngineProfiler()
    cuda = engine.device.type == "cuda"

    async def on_loop(fn: Any) -> JSONResponse:
        try:
            message = await asyncio.wrap_future(engine.scheduler.run_command(fn))
        except InvalidRequestError as err:
            return JSONResponse({"success": False, "message": str(err)}, status_code=400)
        return JSONResponse({"success": True, "message": message})

    @app.post("/start_profile")
    async def start_profile(request: Request):
        body = validate_body(StartProfileBody, await json_body(request))
        return await on_loop(lambda: profiler.start(body, cuda))

    @app.post("/stop_profile")
    async def stop_profile():
        return await on_loop(profiler.stop)
