"""The vision-language example (examples/vlm_shapes): a tiny Qwen2.5-VL warmed up on the answer
format then trained with GRPO names the colour of shapes in held-out pictures, its held-out reward
rising by at least 0.3 over the warm-up. Pictures, data and model are made by the example itself;
images travel from the JSONL rows through the engine (image_data) to the FSDP trainer."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.utils.tracking import read_metrics

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples/vlm_shapes"
KEY = "eval/heldout/reward_mean"


def eval_rewards(run_dir: Path) -> list[float]:
    return [r[KEY] for r in read_metrics(run_dir / "metrics.jsonl") if r.get(KEY) is not None]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_vlm_example_learns_what_it_sees(tmp_path):
    out = tmp_path / "vlm"
    env = {
        **os.environ,
        "MILES_VLM_OUT": str(out),
        # The console scripts (miles) live beside this interpreter.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    start = time.monotonic()
    result = subprocess.run(
        ["bash", str(EXAMPLE / "run.sh"), "--console", "plain"],
        env=env, capture_output=True, text=True, timeout=1100,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    elapsed = time.monotonic() - start
    sft, grpo = eval_rewards(out / "sft"), eval_rewards(out / "grpo")
    print(result.stdout[-400:])
    print(f"held-out reward: {sft[0]:.3f} (start) -> {grpo[0]:.3f} (after SFT) -> "
          f"{grpo[-1]:.3f} in {elapsed:.0f} s")  # fmt: skip
    assert grpo[-1] - grpo[0] >= 0.3, f"GRPO moved the held-out reward {grpo[0]} -> {grpo[-1]}"
    rows = [r for r in read_metrics(out / "grpo" / "metrics.jsonl") if "rollout/reward_mean" in r]
    assert len(rows) == 60  # every rollout logged
    assert {"reward.png", "eval.png"} <= {p.name for p in (out / "grpo" / "plots").iterdir()}
