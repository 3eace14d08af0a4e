"""Shared fixtures: a tiny local checkpoint and real reference-engine servers on loopback.

Engines take ~10 s to start on a CPU, so tests share session-scoped ones; a test that changes an
engine's weights or memory starts its own with `start_engine`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from miles.backends.sglang_utils.reference_engine.launcher import launch_reference_engine
from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint


def running_engine(
    model_path: Path, *extra: str, timeout_s: float = 120.0
) -> AbstractContextManager[str]:
    """A reference engine process on a free loopback port; yields its URL, then stops it."""
    return launch_reference_engine(model_path, extra_args=extra, timeout_s=timeout_s)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A seeded tiny Qwen3 checkpoint with a byte-level tokenizer (vocabulary of 259 tokens)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), seed=0)


@pytest.fixture(scope="session")
def engine_url(tiny_checkpoint) -> Iterator[str]:
    """A shared engine. Tests may raise its weight version but must not change its weights."""
    with running_engine(tiny_checkpoint, "--random-seed", "0") as url:
        yield url


@pytest.fixture(scope="session")
def second_engine_url(tiny_checkpoint) -> Iterator[str]:
    """Another shared engine on the same checkpoint, for tests that balance over two."""
    with running_engine(tiny_checkpoint, "--random-seed", "1") as url:
        yield url


@pytest.fixture(scope="session")
def start_engine():
    """`start_engine(model_path, *flags)`: a context manager running a private engine."""
    return running_engine
