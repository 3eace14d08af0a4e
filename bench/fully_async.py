"""Sync vs one-step async vs fully-async: seconds per step and idle fractions, side by side.

The same workload four times (a tiny checkpoint built here, the CPU demo's prompts, GRPO): sync,
one-step async (--async-train), and fully-async (--max-weight-staleness 2) without and with
--partial-rollout, on the layout where the engine and the trainer each have a core of their own:
one train rank, one reference engine, no colocation. The default workload has long-tailed
generation, as RL rollouts do: the tiny random model ends a response at its end-of-text token
(about 1 in 259 per token), so most responses are short and a few run to the 1024-token budget. Each run is a real `miles train`; the numbers are read from its
metrics, over the steps after the first (start-up and the first weight sync excluded):

- step: `time/step_s`, the wall time of one loop iteration;
- generate: the engine's time to make one rollout, measured in the sync run (`rollout/time_s`),
  and train: the trainer's time per rollout (`time/train_s`); the ideal overlapped step is
  max(generate, train), the sync one generate + train;
- engine idle: the share of a step the engine has no request (fully-async: `async/engine_idle_s`;
  sync and one-step async: the step less the rollout's generation time);
- trainer idle: the share of a step the trainer is not training (step less `time/train_s`).

Run it on an otherwise idle machine (about 3 minutes on 2 cores):

    uv run --frozen python bench/fully_async.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MILES = str(Path(sys.executable).parent / "miles")

MODES = {
    "sync": [],
    "one-step async": ["--async-train", "--off-policy-correction", "tis"],
    "fully-async": ["--fully-async", "--off-policy-correction", "tis",
                    "--max-weight-staleness", "2"],
    "fully-async partial": ["--fully-async", "--off-policy-correction", "tis",
                            "--max-weight-staleness", "2", "--partial-rollout",
                            "--mask-offpolicy-in-partial-rollout"],
}  # fmt: skip


def run(mode_flags: list[str], checkpoint: Path, out: Path, args: argparse.Namespace) -> list[dict]:
    command = [
        MILES, "train", "--hf-checkpoint", str(checkpoint),
        "--prompt-data", str(REPO / "examples/cpu_demo/data/train.jsonl"),
        "--rm-type", "exact_match", "--advantage-estimator", "grpo",
        "--rollout-batch-size", str(args.batch), "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", str(args.response_len), "--rollout-temperature", "1.0",
        "--num-rollout", str(args.rollouts), "--num-steps-per-rollout", str(args.train_steps),
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--rollout-router", "builtin", "--lr", "1e-4",
        "--output-dir", str(out), "--console", "plain", *mode_flags,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"miles train failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    with open(out / "metrics.jsonl") as lines:
        return [json.loads(line) for line in lines]


def summary(records: list[dict], mode: str) -> dict[str, float]:
    steps = [r for r in records if "time/step_s" in r][1:]  # the first carries the start-up
    step = statistics.mean(r["time/step_s"] for r in steps)
    train = statistics.mean(r["time/train_s"] for r in steps)
    if mode.startswith("fully-async"):
        engine_idle = statistics.mean(r["async/engine_idle_s"] for r in steps)
    else:
        engine_idle = step - statistics.mean(r["rollout/time_s"] for r in steps)
    generate = statistics.mean(r["rollout/time_s"] for r in steps)
    return {"step": step, "train": train, "generate": generate,
            "engine_idle": max(engine_idle, 0.0) / step, "trainer_idle": (step - train) / step}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="prompts per rollout (x4 samples)")
    parser.add_argument("--response-len", type=int, default=1024)
    parser.add_argument("--train-steps", type=int, default=4, help="optimizer steps per rollout")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--keep", type=Path, help="keep the runs' outputs in this directory")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.keep:
            tmp = str(args.keep)
            args.keep.mkdir(parents=True, exist_ok=True)
        checkpoint = Path(tmp) / "base"
        subprocess.run(
            [sys.executable, "-m", "miles.backends.sglang_utils.tiny_checkpoint", str(checkpoint)],
            check=True, capture_output=True,
        )  # fmt: skip
        for mode in args.modes:
            out = Path(tmp) / mode.replace(" ", "_")
            results[mode] = summary(run(MODES[mode], checkpoint, out, args), mode)
    sync = results.get("sync") or next(iter(results.values()))
    generate, train = sync["generate"], sync["train"]
    ideal = max(generate, train)
    print(f"{os.cpu_count()} CPU cores, 1 train rank + 1 reference engine; {args.rollouts} "
          f"rollouts of {args.batch}x4 samples, {args.response_len} tokens, "
          f"{args.train_steps} optimizer steps each")  # fmt: skip
    print(
        f"sync phases: generate {generate:.2f} s, train {train:.2f} s; "
        f"max(generate, train) = {ideal:.2f} s, generate + train = {generate + train:.2f} s"
    )
    print(f"  {'mode':<20} {'s/step':>7} {'vs sync':>8} {'/ max(g,t)':>10} "
          f"{'engine idle':>12} {'trainer idle':>13}")  # fmt: skip
    for mode, r in results.items():
        print(f"  {mode:<20} {r['step']:7.2f} {sync['step'] / r['step']:7.2f}x "
              f"{r['step'] / ideal:10.2f} {r['engine_idle']:11.0%} {r['trainer_idle']:12.0%}")  # fmt: skip
    fastest = min(results, key=lambda mode: results[mode]["step"])
    print(f"fastest: {fastest}")


if __name__ == "__main__":
    main()
