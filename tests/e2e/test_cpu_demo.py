"""The README's main job: the CPU demo trains and the held-out reward rises by at least 0.3."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.utils.tracking import read_metrics

REPO = Path(__file__).resolve().parents[2]
KEY = "eval/heldout/reward_mean"


def eval_rewards(run_dir: Path) -> list[float]:
    return [r[KEY] for r in read_metrics(run_dir / "metrics.jsonl") if r.get(KEY) is not None]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_cpu_demo_learns_within_ten_minutes(tmp_path):
    env = {
        **os.environ,
        "MILES_DEMO_OUT": str(tmp_path / "demo"),
        # The console scripts (miles) live beside this interpreter.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    start = time.monotonic()
    result = subprocess.run(
        ["bash", str(REPO / "examples/cpu_demo/run.sh"), "--console", "plain"],
        env=env, capture_output=True, text=True, timeout=1100,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    grpo = eval_rewards(tmp_path / "demo" / "grpo")
    sft = eval_rewards(tmp_path / "demo" / "sft")
    print(result.stdout[-600:])
    print(f"held-out reward: {sft[0]:.3f} (start) -> {grpo[0]:.3f} (after SFT) -> {grpo[-1]:.3f}")
    assert grpo[-1] - grpo[0] >= 0.3, f"GRPO moved the held-out reward {grpo[0]} -> {grpo[-1]}"
    assert grpo[-1] - sft[0] >= 0.3
    assert elapsed < 600, f"the demo took {elapsed:.0f} s"
    plots = {p.name for p in (tmp_path / "demo" / "grpo" / "plots").iterdir()}
    assert {"reward.png", "eval.png"} <= plots
