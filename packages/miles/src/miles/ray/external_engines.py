"""Engines a run did not launch (--rollout-external-engine-addrs): what it checks before using them.

At start every engine must answer /health_generate within --engine-startup-timeout-s and report
(/get_model_info `model_path`) the checkpoint the run trains (`serves_checkpoint`). The run never
stops, restarts, sleeps or wakes them (`EngineFleet` owns no process of theirs); it does generate
on them and push its weights into them (docs/guides/recipes.md: "External engines").
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import PurePosixPath

from miles.backends.sglang_utils.client import EngineClient, EngineError

logger = logging.getLogger(__name__)


class ExternalEngineError(RuntimeError):
    """An external engine does not answer, or serves another model than --hf-checkpoint."""


def serves_checkpoint(model_path: str, hf_checkpoint: str) -> bool:
    """Whether an engine that reports `model_path` serves `hf_checkpoint`.

    A path that exists on this host must be the same directory. Any other (a path on the
    engine's own host, relative to its working directory, or a hub id) can only be compared by
    name: its last component must be the checkpoint's ("Qwen/Qwen3-0.6B" and
    "/models/Qwen3-0.6B" agree). The name check is enough because the run's first weight update
    replaces whatever weights the engine loaded; what must match is the architecture, and a
    different one fails that update, naming the tensor.
    """
    if os.path.isabs(model_path) and os.path.exists(model_path):
        return os.path.realpath(model_path) == os.path.realpath(hf_checkpoint)
    return _name(model_path) == _name(hf_checkpoint)


def _name(path: str) -> str:
    return PurePosixPath(path.rstrip("/")).name


async def check_external_engines(
    urls: list[str], *, hf_checkpoint: str, admin_key: str | None, timeout_s: float
) -> None:
    """Every engine in `urls` can generate (within `timeout_s`) and serves `hf_checkpoint`;
    ExternalEngineError naming the engine, what it answered and the fix otherwise."""
    logger.info("waiting for %d external engine(s) to answer /health_generate (at most %.0f s): "
                "%s", len(urls), timeout_s, " ".join(urls))  # fmt: skip
    await asyncio.gather(*(_check(url, hf_checkpoint, admin_key, timeout_s) for url in urls))


async def _check(url: str, hf_checkpoint: str, admin_key: str | None, timeout_s: float) -> None:
    async with EngineClient(url, api_key=admin_key, max_retries=0) as client:
        try:
            await client.wait_until_healthy(timeout_s=timeout_s)
            info = await client.get_model_info()
        except EngineError as err:
            raise ExternalEngineError(
                f"external engine {url} (--rollout-external-engine-addrs) cannot generate: "
                f"{err}; start it first, or fix its address"
            ) from err
    model_path = str(info.get("model_path", ""))
    if not serves_checkpoint(model_path, hf_checkpoint):
        raise ExternalEngineError(
            f"external engine {url} serves {model_path!r}, not --hf-checkpoint {hf_checkpoint}: "
            "the run would train one model and generate with another; start the engine with "
            f"--model-path {hf_checkpoint} (or its copy of that checkpoint under the same name)"
        )
    logger.info("external engine %s serves %s at weight version %s", url, model_path,
                info.get("weight_version"))  # fmt: skip
