"""Start-up of a run: seconds from launching `miles train` to being ready to generate, by phase.

Runs the CPU demo's stage 2 (examples/cpu_demo/grpo.yaml: one reference engine, FSDP on two
ranks) for one rollout, from a tiny checkpoint built here, and reads the `startup/*` metrics the
run logs with its first rollout (`miles.ray.startup_clock`). Phases overlap: the engine loads its
model while the rollout manager reads the prompts and the train ranks build theirs, so each phase
is its own duration and "ready" is the wall time. It also times `miles train --help`, and the
import floor of each kind of process on this machine (one process each, nothing else running), so
the phases can be read against what no code of ours can cut. Run it on an otherwise idle machine:

    uv run --frozen python bench/startup.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MILES = str(Path(sys.executable).parent / "miles")

# (phase key in the run's metrics, what it covers); in the order they start.
PHASES = [
    ("ray", "Ray start (local instance)"),
    ("placement", "placement group reserved"),
    ("engines", "engine: actor + server process start + model load, until it answers"),
    ("data", "rollout manager: tokenizer + prompts (beside the engine)"),
    ("trainers", "train ranks: process start to model built (beside the engine)"),
    ("trainer_imports", "  of which rank 0's imports (backend, torch, transformers)"),
    ("trainer_build", "  of which rank 0's process group, model and optimizer build"),
    ("first_weight_update", "first weight sync to the engine"),
]
# What each kind of process must import before its work, whatever our code does.
FLOORS = {
    "ray (any Ray worker)": "import ray",
    "torch": "import torch",
    "manager's tokenizer (load_tokenizer)": (
        "from miles.utils.tokenizers import load_tokenizer; load_tokenizer({checkpoint!r})"
    ),
    "AutoTokenizer (imports torch)": (
        "from transformers import AutoTokenizer; AutoTokenizer.from_pretrained({checkpoint!r})"
    ),
    "FSDP train rank (its actor module)": "import miles.backends.fsdp_utils.actor",
    "reference engine (its server module)": (
        "import miles.backends.sglang_utils.reference_engine.cli"
    ),
}


def seconds_of(command: list[str], **kwargs) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, **kwargs)
    return time.perf_counter() - start


def run_stage_two(work: Path, checkpoint: Path) -> tuple[float, dict]:
    """Launch stage 2 for one rollout; (launch time, the first rollout's record)."""
    out = work / "grpo"
    command = [
        MILES, "train", "--config", str(REPO / "examples/cpu_demo/grpo.yaml"),
        "--hf-checkpoint", str(checkpoint), "--save", str(out / "checkpoints"),
        "--output-dir", str(out), "--num-rollout", "1", "--console", "plain",
    ]  # fmt: skip
    launched = time.time()
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"miles train failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    with open(out / "metrics.jsonl") as lines:
        records = [json.loads(line) for line in lines]
    # The first rollout's record (the evaluation before training is logged before it).
    return launched, next(r for r in records if "startup/total_s" in r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-floors", action="store_true", help="only the run and --help")
    args = parser.parse_args()
    help_s = seconds_of([MILES, "train", "--help"])
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "base"
        subprocess.run(
            [sys.executable, "-m", "miles.backends.sglang_utils.tiny_checkpoint", str(checkpoint)],
            check=True, capture_output=True,
        )  # fmt: skip
        launched, record = run_stage_two(Path(tmp), checkpoint)
        floors = {} if args.skip_floors else {
            name: seconds_of([sys.executable, "-c", statement.format(checkpoint=str(checkpoint))])
            for name, statement in FLOORS.items()
        }  # fmt: skip
    driver_s = record["startup/began_at"] - launched
    ready_s = driver_s + record["startup/total_s"]
    print(f"CPU demo stage 2, {os.cpu_count()} CPU cores: ready to generate {ready_s:.1f} s after "
          "`miles train` was launched")  # fmt: skip
    print(f"  {'phase':<22} {'seconds':>8}  covers")
    print(f"  {'driver':<22} {driver_s:8.1f}  interpreter start, imports, config")
    for key, covers in PHASES:
        value = record.get(f"startup/{key}_s")
        if value is not None:
            print(f"  {key:<22} {value:8.1f}  {covers}")
    print(f"  {'ready (wall)':<22} {ready_s:8.1f}  launch to the end of the first weight sync")
    if "time/step_s" in record:  # what start-up left to the first step (the manager's torch)
        print(f"first rollout step after ready: {record['time/step_s']:.1f} s (generate "
              f"{record.get('time/generate_s', float('nan')):.1f} s)")  # fmt: skip
    print(f"`miles train --help`: {help_s:.2f} s")
    if floors:
        print("import floors, one process each (no code of ours runs before these imports):")
    for name, seconds in floors.items():
        print(f"  {name:<38} {seconds:6.1f} s")


if __name__ == "__main__":
    main()
