"""Shared fixtures: tiny local checkpoints and real reference-engine servers on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles.backends.sglang_utils.reference_engine import ReferenceEngine, ReferenceEngineConfig
from miles.backends.sglang_utils.reference_engine.launcher import launch_reference_engine
from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

from .in_process_engine import serve_in_process
from .lora_support import LORA_ADMIN_KEY, LORA_ENGINE_TARGETS
from .vision_support import VisionEngine, serve_vlm


def running_engine(model_path: Path, *extra: str, timeout_s: float = 120.0):
    """A reference engine process on a free loopback port; yields its URL, then stops it."""
    return launch_reference_engine(model_path, extra_args=extra, timeout_s=timeout_s)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), seed=0)


@pytest.fixture(scope="session")
def other_checkpoint(tmp_path_factory) -> Path:
    """Same architecture, different weights: what a trainer would push after a step."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-other"), seed=1)


@pytest.fixture(scope="session")
def engine_url(tiny_checkpoint) -> Iterator[str]:
    """A shared engine for tests that do not change its weights or memory."""
    with running_engine(tiny_checkpoint, "--random-seed", "0") as url:
        yield url


@pytest.fixture(scope="session")
def start_engine():
    """`start_engine(model_path, *flags)`: a context manager running a private engine."""
    return running_engine


@pytest.fixture(scope="session")
def lora_engine(tiny_checkpoint) -> Iterator[tuple[ReferenceEngine, httpx.Client]]:
    """One engine serving LoRA adapters (rank <= 8, the fast path), shared by the LoRA tests,
    and a client of it with its admin key; each test loads adapters under names of its own."""
    config = ReferenceEngineConfig(
        model_path=str(tiny_checkpoint), device="cpu", admission_quiet_ms=0, enable_lora=True,
        max_lora_rank=8, lora_target_modules=list(LORA_ENGINE_TARGETS),
        admin_api_key=LORA_ADMIN_KEY,
    )  # fmt: skip
    with serve_in_process(config, headers={"Authorization": f"Bearer {LORA_ADMIN_KEY}"}) as both:
        yield both


@pytest.fixture(scope="session", params=["qwen2_5_vl", "qwen3_vl"])
def vlm(request, tmp_path_factory) -> Iterator[VisionEngine]:
    """One engine per tiny VLM architecture, shared by the vision tests (tests that change its
    weights put the checkpoint's back), with its processor and a float64 copy of the model."""
    with serve_vlm(tmp_path_factory.mktemp(request.param), request.param) as vision_engine:
        yield vision_engine
