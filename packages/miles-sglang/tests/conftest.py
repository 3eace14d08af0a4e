"""Shared fixtures: a tiny local checkpoint and real reference-engine servers on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from miles.backends.sglang_utils.reference_engine.launcher import launch_reference_engine
from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint


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
