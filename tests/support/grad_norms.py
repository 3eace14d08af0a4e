"""Gradient-norm checks for CI: record per-step norms of one run, compare another run against them.

Two runs that should train identically (a rerun, the other backend, another parallel layout) must
produce the same gradient norms step by step, within a tolerance. Call it on one rank only. A test
helper: no miles wheel ships it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Literal

GradNormMode = Literal["save", "compare"]


class GradNormMismatch(AssertionError):
    """This run's gradient norm differs from the recorded one by more than the tolerance."""


class GradNormStepMissing(KeyError):
    """The reference file has no gradient norm for the step being compared."""

    def __str__(self) -> str:
        # KeyError's own __str__ shows the repr of its argument, quotes and escapes included.
        return str(self.args[0]) if self.args else ""


def check_grad_norm(
    grad_norm: float,
    *,
    path: str | Path,
    step: int,
    rtol: float = 0.03,
    mode: GradNormMode,
) -> None:
    """Record (`mode="save"`) or check (`mode="compare"`) the gradient norm of `step`.

    The file at `path` is a JSON object `{"<step>": norm}`. Saving adds or replaces `step` and
    keeps the other steps. Comparing raises `GradNormMismatch` when `|grad_norm - reference| >
    rtol * |reference|` (a non-finite `grad_norm` always mismatches) and `GradNormStepMissing`
    when the file has no entry for `step`.
    """
    path = Path(path)
    if rtol < 0:
        raise ValueError(f"rtol must be >= 0, got {rtol}")
    if mode == "save":
        _save(path, step, grad_norm)
    elif mode == "compare":
        _compare(path, step, grad_norm, rtol)
    else:
        raise ValueError(f"mode must be 'save' or 'compare', got {mode!r}")


def _save(path: Path, step: int, grad_norm: float) -> None:
    if not math.isfinite(grad_norm):
        raise ValueError(
            f"grad norm of step {step} is {grad_norm}; a non-finite norm is no reference to "
            "compare against: fix the run before saving its norms"
        )
    norms = _load(path) if path.exists() else {}
    norms[str(step)] = float(grad_norm)
    ordered = dict(sorted(norms.items(), key=lambda item: int(item[0])))
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write-then-rename, so a run killed mid-write leaves the previous file intact.
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
        json.dump(ordered, tmp, indent=1)
        tmp.write("\n")
    os.replace(tmp.name, path)


def _compare(path: Path, step: int, grad_norm: float, rtol: float) -> None:
    if not path.exists():
        raise FileNotFoundError(
            f"no reference grad norms at {path}; record them first with "
            "check_grad_norm(..., mode='save') in the reference run"
        )
    norms = _load(path)
    if str(step) not in norms:
        recorded = sorted(int(key) for key in norms)
        raise GradNormStepMissing(
            f"{path} has no grad norm for step {step} (recorded steps: {recorded}); the reference "
            "run must save every step that is compared"
        )
    reference = norms[str(step)]
    difference = abs(grad_norm - reference)
    if reference != 0:
        relative = difference / abs(reference)
    else:
        relative = 0.0 if difference == 0 else math.inf
    if not math.isfinite(grad_norm) or difference > rtol * abs(reference):
        raise GradNormMismatch(
            f"grad norm of step {step} is {grad_norm!r}, reference {reference!r} (from {path}): "
            f"relative difference {relative:.4g} > rtol {rtol:g}"
        )


def _load(path: Path) -> dict[str, float]:
    try:
        norms = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); delete it and save again") from error
    if not isinstance(norms, dict):
        raise ValueError(
            f"{path} holds a {type(norms).__name__}, expected a JSON object {{step: grad_norm}}; "
            "delete it and save again"
        )
    return norms
