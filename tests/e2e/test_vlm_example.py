"""The vision-language example (examples/vlm_shapes): a tiny Qwen2.5-VL warmed up on the answer
format then trained with GRPO names the colour of shapes in held-out pictures, its held-out reward
rising by at least 0.3 over the warm-up. Pictures, data and model are made by the example itself;
images travel from the JSONL rows through the engine (image_data) to the FSDP trainer."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.utils.tracking import read_metrics
from tests.support.examples import run_example

KEY = "eval/heldout/reward_mean"


def eval_rewards(run_dir: Path) -> list[float]:
    return [r[KEY] for r in read_metrics(run_dir / "metrics.jsonl") if r.get(KEY) is not None]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_vlm_example_learns_what_it_sees(tmp_path):
    out = tmp_path / "vlm"
    stdout, elapsed = run_example("vlm_shapes", "MILES_VLM_OUT", out)
    sft, grpo = eval_rewards(out / "sft"), eval_rewards(out / "grpo")
    print(stdout[-400:])
    print(f"held-out reward: {sft[0]:.3f} (start) -> {grpo[0]:.3f} (after SFT) -> "
          f"{grpo[-1]:.3f} in {elapsed:.0f} s")  # fmt: skip
    assert grpo[-1] - grpo[0] >= 0.3, f"GRPO moved the held-out reward {grpo[0]} -> {grpo[-1]}"
    rows = [r for r in read_metrics(out / "grpo" / "metrics.jsonl") if "rollout/reward_mean" in r]
    assert len(rows) == 50  # every rollout logged
    # The step-0 check on image prompts: the trainer's log-probs are the engine's (1.2e-7 here).
    assert rows[0]["check/logprob_abs_diff"] < 1e-5
    assert {"reward.png", "eval.png"} <= {p.name for p in (out / "grpo" / "plots").iterdir()}
