"""Print what the tool-use example learned: the held-out reward of multi-turn episodes before and
after each stage, how often the policy called the calculator, and the tool failures it got past."""

from __future__ import annotations

import sys
from pathlib import Path

from miles.utils.tracking import read_metrics

EVAL = "eval/heldout/reward_mean"
FAILURES = ("raised", "timeout", "bad_arguments", "unknown_tool")


def eval_curve(run_dir: Path) -> list[float]:
    return [r[EVAL] for r in read_metrics(run_dir / "metrics.jsonl") if r.get(EVAL) is not None]


def rollouts(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "rollout/tool_calls_mean" in r]


def failure_counts(run_dir: Path) -> dict[str, int]:
    """Failed tool calls of the run's training rollouts, summed, by kind."""
    records = rollouts(run_dir)
    return {
        kind: int(sum(r.get(f"rollout/tool_failures/{kind}", 0) for r in records))
        for kind in FAILURES
    }


def main(out: str) -> int:
    sft, grpo = eval_curve(Path(out) / "sft"), eval_curve(Path(out) / "grpo")
    print(
        f"held-out reward: start {sft[0]:.3f} -> after warm-up {grpo[0]:.3f} -> after GRPO "
        f"{grpo[-1]:.3f} (GRPO {grpo[-1] - grpo[0]:+.3f})"
    )
    calls = [r["rollout/tool_calls_mean"] for r in rollouts(Path(out) / "grpo")]
    print(
        f"calculator calls per episode in GRPO: first rollout {calls[0]:.2f}, last {calls[-1]:.2f}"
    )
    failures = ", ".join(f"{k} {n}" for k, n in failure_counts(Path(out) / "grpo").items())
    print(f"failed calls over GRPO (the episode went on with an error message): {failures}")
    print(f"curves: {out}/sft/plots, {out}/grpo/plots")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/tool_use"))
