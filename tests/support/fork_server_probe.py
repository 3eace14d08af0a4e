"""Run by test_distributed.py as a script in a fresh interpreter: asks `run_distributed` for workers
with different preload lists and prints, as JSON, each worker's fork server (its parent's pid) and
which probe modules it found already imported.

A fresh interpreter has no fork server yet, so the restarts this causes start servers with torch
only, not the suite's server holding every preload asked for so far (megatron-core among them).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: `tests.support` lives under the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.distributed import run_distributed

# Standard-library modules that torch does not import (colorsys would not do: a plotting import
# pulls it in): what a worker finds in sys.modules came from its server's preload.
PROBES = ("tabnanny", "pyclbr")
BASE = ("torch", "torch.distributed")


def preloaded(rank: int, names: tuple[str, ...]) -> tuple[int, list[str]]:
    return os.getppid(), [name for name in names if name in sys.modules]


def ask(*extra: str) -> tuple[int, list[str]]:
    return run_distributed(preloaded, 1, PROBES, preload=(*BASE, *extra))[0]


if __name__ == "__main__":
    print(json.dumps([ask("tabnanny"), ask(), ask("pyclbr"), ask("tabnanny")]))
