"""A failed run's report: its cause first, in the user's words, and the traceback in a file.

A failure inside a Ray actor reaches the driver wrapped in `RayTaskError`, whose text is the whole
remote traceback (hundreds of lines). `describe` unwraps it to the exception that was raised
(`TrainRankError`, `EngineFailedError`, ...), whose message already names the rank or the engine;
`write_failure_log` keeps the full traceback in the run's output directory, appended, so a
re-run's failure never replaces an earlier one.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

FAILURE_LOG = "failure.log"


def root_cause(error: BaseException) -> BaseException:
    """`error` without Ray's wrappers: the exception raised where the failure happened."""
    from ray.exceptions import RayTaskError

    while isinstance(error, RayTaskError):
        cause = getattr(error, "cause", None)
        if not isinstance(cause, BaseException) or cause is error:
            break
        error = cause
    return error


def describe(error: BaseException) -> str:
    """The cause in one line (its type and first line), then the rest of its message."""
    cause = root_cause(error)
    text = str(cause).strip() or "(no message)"
    return f"{type(cause).__name__}: {text}"


def write_failure_log(output_dir: str | Path, error: BaseException) -> Path:
    """Append `error`'s full traceback (Ray's remote one included) to the run's failure log."""
    path = Path(output_dir) / FAILURE_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    trace = "".join(traceback.format_exception(error))
    with open(path, "a") as f:
        f.write(f"=== {stamp}: {describe(error).splitlines()[0]}\n{trace}\n")
    return path
