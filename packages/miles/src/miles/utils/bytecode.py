"""Whether this Python imports torch and transformers from cached bytecode.

With PYTHONDONTWRITEBYTECODE set (as many container images do) and packages installed without
their bytecode (pip and uv compile none by default), every process of a run compiles every
module it imports from source: an FSDP train rank took 11.5-13.3 s to import instead of 5.4-6.0 s
on 2 cores, and a run starts four or more such processes. `miles train` says so before it starts.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

CHECKED_MODULES = ("torch", "transformers")
"""The largest imports of a run's processes; their bytecode stands for the rest."""


def uncached_modules(modules: tuple[str, ...] = CHECKED_MODULES) -> list[str]:
    """Those of `modules` that every process will compile from source: this interpreter may not
    write bytecode and none was written at install. Empty when bytecode may be written."""
    if not sys.flags.dont_write_bytecode:
        return []
    uncached = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if origin and origin.endswith(".py"):
            if not Path(importlib.util.cache_from_source(origin)).is_file():
                uncached.append(name)
    return uncached


def uncached_bytecode_warning() -> str | None:
    """What to tell the user when `uncached_modules()` is not empty; None otherwise."""
    uncached = uncached_modules()
    if not uncached:
        return None
    return (
        f"PYTHONDONTWRITEBYTECODE is set and {', '.join(uncached)} has no compiled bytecode: "
        "every process of this run compiles its imports from source, about twice the start-up "
        "time. Compile the environment once (`uv sync --compile-bytecode`, or `python -m "
        "compileall -q` over its site-packages), or unset PYTHONDONTWRITEBYTECODE so that the "
        "first run writes the bytecode"
    )
