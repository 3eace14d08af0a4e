"""Tools for the tool-rollout tests, importable as "tool_fns:NAME" (the tests put this folder on
sys.path)."""

from __future__ import annotations

import asyncio
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Longer notes stay out of the spec."""
    return a + b


def explode(reason: str = "boom") -> str:
    """A tool that always raises."""
    raise RuntimeError(reason)


def hang(seconds: float) -> str:
    """A sync tool that takes too long."""
    time.sleep(seconds)
    return "late"


async def wait(seconds: float) -> str:
    """An async tool that takes too long."""
    await asyncio.sleep(seconds)
    return "late"


def untyped(x):  # no annotation: what JSON type x takes is unknown
    return x
