"""The tool-use example learns: GRPO over multi-turn episodes with a calculator raises the held-out
reward by at least 0.3, and the calculator's failures (it raises, it hangs) cost episodes, not the
run."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.utils.tracking import read_metrics
from tests.support.examples import run_example

KEY = "eval/heldout/reward_mean"


def records(run_dir: Path) -> list[dict]:
    return list(read_metrics(run_dir / "metrics.jsonl"))


def eval_rewards(run_dir: Path) -> list[float]:
    return [r[KEY] for r in records(run_dir) if r.get(KEY) is not None]


def failed_calls(run_dir: Path, kind: str) -> float:
    return sum(r.get(f"rollout/tool_failures/{kind}", 0.0) for r in records(run_dir))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_tool_use_example_learns_to_call_its_calculator(tmp_path):
    out = tmp_path / "tool_use"
    stdout, elapsed = run_example("tool_use", "MILES_EXAMPLE_OUT", out)
    print(stdout[-800:])
    sft, grpo = eval_rewards(out / "sft"), eval_rewards(out / "grpo")
    print(f"held-out reward: {sft[0]:.3f} (start) -> {grpo[0]:.3f} (after SFT) -> {grpo[-1]:.3f}")
    # Measured (README): 0.000 -> 0.488 -> 0.949 with the defaults; rises of +0.46 to +0.49 and
    # final rewards of 0.81 to 0.98 over three seeds.
    assert grpo[-1] - grpo[0] >= 0.3, f"GRPO moved the held-out reward {grpo[0]} -> {grpo[-1]}"
    assert grpo[-1] >= 0.7
    # The calculator raised (a division by zero) and hung (a never-ending decimal) on training
    # prompts, and the run went on.
    assert failed_calls(out / "grpo", "raised") > 0
    assert failed_calls(out / "grpo", "timeout") > 0
    calls = [
        r["rollout/tool_calls_mean"]
        for r in records(out / "grpo")
        if "rollout/tool_calls_mean" in r
    ]
    assert calls[-1] > calls[0]
    assert elapsed < 600, f"the example took {elapsed:.0f} s"
    plots = {p.name for p in (out / "grpo" / "plots").iterdir()}
    assert {"reward.png", "eval.png"} <= plots
