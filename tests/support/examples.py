"""Running an example's run.sh the way a user does, for the e2e tests that check it learns."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_example(name: str, out_variable: str, out: Path) -> tuple[str, float]:
    """Run `examples/<name>/run.sh --console plain` with its output directory variable set to
    `out`; its stdout and wall time. Fails the test, with the output's tail, if it fails."""
    env = {
        **os.environ,
        out_variable: str(out),
        # The console scripts (miles) live beside this interpreter.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    start = time.monotonic()
    result = subprocess.run(
        ["bash", str(REPO / "examples" / name / "run.sh"), "--console", "plain"],
        env=env, capture_output=True, text=True, timeout=1100,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout, elapsed
