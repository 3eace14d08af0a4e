"""Print what the CPU demo learned: held-out evaluation reward before and after each stage."""

from __future__ import annotations

import sys
from pathlib import Path

from miles.utils.tracking import read_metrics

KEY = "eval/heldout/reward_mean"


def eval_curve(run_dir: Path) -> list[tuple[int, float]]:
    return [
        (r["rollout_id"], r[KEY])
        for r in read_metrics(run_dir / "metrics.jsonl")
        if r.get(KEY) is not None
    ]


def main(out: str) -> int:
    sft, grpo = eval_curve(Path(out) / "sft"), eval_curve(Path(out) / "grpo")
    start, after_sft = sft[0][1], sft[-1][1]
    rl_start, end = grpo[0][1], grpo[-1][1]
    print(
        f"held-out reward: start {start:.3f} -> after warm-up {after_sft:.3f} -> after GRPO {end:.3f}"
    )
    print(
        f"GRPO alone: {rl_start:.3f} -> {end:.3f} ({end - rl_start:+.3f}); whole demo {end - start:+.3f}"
    )
    print(f"curves: {out}/sft/plots, {out}/grpo/plots")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/cpu_demo"))
