"""Soak: a long CPU run under repeated faults, against the same run without them.

A disaggregated run (two FSDP train ranks, one reference engine, a tiny Qwen3 on the CPU demo's
task, a checkpoint every `--save-interval` rollouts) trains for `--rollouts` rollouts while a
thread SIGKILLs the engine every `--engine-every` seconds and a train rank every `--rank-every`
seconds (alternating ranks). The same run then goes again with no fault. Printed, side by side:
rollouts lost (logged ids missing: target 0), engine and train-group restarts, seconds lost,
whether every logged value equals the unfaulted run's (timings and the restart counts aside), and
whether the final weights are equal, tensor for tensor.

The defaults make about 20 minutes of faulted run on an idle 2-core machine (a rollout takes
about 0.6 s; then as long again unfaulted). Requests go one at a time (`--rollout-concurrency 1`) so that a re-sent request is
sampled as the first one was. Run it on an otherwise idle machine:

    uv run --frozen python bench/soak.py                 # about 40 minutes
    uv run --frozen python bench/soak.py --rollouts 300 --engine-every 30 --rank-every 75
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray
import torch
from safetensors.torch import load_file

from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint
from miles.config import load_config
from miles.ray.run import Run
from miles.train import train_sync
from miles.utils.tracking import read_metrics

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tools/ is the repository's, not an installed package

from tools.compare_runs import compare_records  # noqa: E402 (after the path above)

MILES = str(Path(sys.executable).parent / "miles")
# What differs between a faulted and an unfaulted run by design: timings, the restart counts, the
# engines' health, the groups sent again after their engine died, start-up.
IGNORED = [r"^time/", r"/seconds", r"_s$", r"^startup/", r"^check/", r"restarts$",
           r"^train/replayed_rollouts$", r"^engine/", r"^rollout/reissued_groups$", r"per_s$",
           r"^perf/", r"^memory/"]  # fmt: skip


def flags(checkpoint: Path, out: Path, rollouts: int, save_interval: int) -> list[str]:
    return [
        "--hf-checkpoint", str(checkpoint),
        "--prompt-data", str(REPO / "examples/cpu_demo/data/train.jsonl"),
        "--rm-type", "exact_match", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "4", "--num-rollout", str(rollouts),
        "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1",
        "--rollout-concurrency", "1", "--rollout-router", "builtin",
        "--save", str(out / "checkpoints"), "--save-interval", str(save_interval),
        "--output-dir", str(out), "--console", "plain", "--lr", "0.002",
        # A random model scores 0 on the task: the entropy bonus gives every step a gradient, so
        # the weights move and their equality at the end means something.
        "--entropy-coef", "0.01",
        # Every fault is restarted: the defaults (3 each) bound a real run's failing machine.
        "--max-engine-restarts", "1000", "--max-train-restarts", "1000",
    ]  # fmt: skip


class Faults:
    """SIGKILLs the engine every `engine_every` s and a train rank every `rank_every` s."""

    def __init__(self, started: Run, engine_every: float, rank_every: float) -> None:
        self.started, self.engine_every, self.rank_every = started, engine_every, rank_every
        self.engines_killed = self.ranks_killed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Faults:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        start = time.monotonic()
        next_engine, next_rank = self.engine_every, self.rank_every
        while not self._stop.wait(1.0):
            elapsed = time.monotonic() - start
            try:
                if elapsed >= next_engine:
                    next_engine += self.engine_every
                    pids = ray.get(self.started.rollout_manager.engine_pids.remote(), timeout=30)
                    self._kill(pids[0])
                    self.engines_killed += 1
                if elapsed >= next_rank:
                    next_rank += self.rank_every
                    actors = self.started.trainers.actors  # new actors after each restart
                    actor = actors[self.ranks_killed % len(actors)]
                    self._kill(
                        ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
                    )
                    self.ranks_killed += 1
            except Exception as err:  # a restart in progress: try again at the next tick
                print(f"soak: no fault this tick ({type(err).__name__}: {err})", flush=True)

    @staticmethod
    def _kill(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(
    checkpoint: Path, out: Path, args: argparse.Namespace, *, faults: bool
) -> tuple[list[dict], float, Faults | None]:
    config = load_config(flags(checkpoint, out, args.rollouts, args.save_interval))
    start = time.monotonic()
    injected = None
    with Run(config) as started:
        if faults:
            with Faults(started, args.engine_every, args.rank_every) as injected:
                train_sync(started)
        else:
            train_sync(started)
    return list(read_metrics(out / "metrics.jsonl")), time.monotonic() - start, injected


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    exported = out / "export"
    subprocess.run([MILES, "export-hf", str(out / "checkpoints"), str(exported)], check=True,
                   capture_output=True)  # fmt: skip
    return load_file(exported / "model.safetensors")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=1800, help="rollouts of each run")
    parser.add_argument(
        "--engine-every", type=float, default=120.0, help="seconds between engine kills"
    )
    parser.add_argument(
        "--rank-every", type=float, default=300.0, help="seconds between rank kills"
    )
    parser.add_argument("--save-interval", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="miles-soak-") as tmp:
        root = Path(tmp)
        checkpoint = build_tiny_checkpoint(root / "model", seed=0)
        faulted, faulted_s, injected = run(checkpoint, root / "faulted", args, faults=True)
        clean, clean_s, _ = run(checkpoint, root / "clean", args, faults=False)
        assert injected is not None
        ids = {r["rollout_id"] for r in faulted}
        lost = sorted(set(range(args.rollouts)) - ids)
        last = faulted[-1]
        differences = compare_records(clean, faulted, ignore=IGNORED)
        mine, theirs = final_weights(root / "faulted"), final_weights(root / "clean")
        same_weights = mine.keys() == theirs.keys() and all(
            torch.equal(mine[k], theirs[k]) for k in mine
        )
        print(f"{'':34}{'faulted':>12}{'unfaulted':>12}")
        print(f"{'wall time (s)':34}{faulted_s:12.0f}{clean_s:12.0f}")
        print(f"{'rollouts logged':34}{len(ids):12d}{len(clean):12d}")
        print(f"{'rollouts lost (target 0)':34}{len(lost):12d}{0:12d}")
        print(f"{'engine kills / restarts':34}{injected.engines_killed:>5d} / "
              f"{int(last.get('engine/restarts', 0)):<5d}")  # fmt: skip
        print(f"{'train rank kills / group restarts':34}{injected.ranks_killed:>5d} / "
              f"{int(last.get('train/restarts', 0)):<5d}")  # fmt: skip
        print(f"{'rollouts replayed':34}{int(last.get('train/replayed_rollouts', 0)):12d}")
        lost_s = last.get("engine/seconds_lost", 0.0) + last.get("train/seconds_lost", 0.0)
        print(f"{'seconds lost to faults':34}{lost_s:12.1f}")
        print(f"{'values differing from unfaulted':34}{len(differences):12d}")
        print(f"{'final weights equal':34}{same_weights!s:>12}")
        for line in differences[:10]:
            print("  ", line)
    return 0 if not lost and same_weights and not differences else 1


if __name__ == "__main__":
    sys.exit(main())
