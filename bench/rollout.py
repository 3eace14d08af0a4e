"""Rollout throughput: one reference engine against two behind the built-in balancer.

A full rollout is generation + rewards + conversion to train data (the RolloutManager's `generate`,
on real Ray, with the engines in their own placement bundles). Both set-ups get the same prompts,
samples per prompt and response length in one invocation; the script prints samples/s of each and
the scaling efficiency (speed-up / number of engines). Run it on an otherwise idle machine:

    uv run --frozen python bench/rollout.py [--rollouts 4] [--prompts 32] [--samples 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import ray

from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint
from miles.config import load_config
from miles.ray.cluster import init_ray
from miles.ray.placement import create_placement, plan_placement, remove_placement
from miles.ray.rollout_manager import RolloutManager


def write_prompts(path: Path, count: int) -> None:
    rows = [{"input": f"Count to {i % 10}:", "label": str(i % 10)} for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def measure(
    args: argparse.Namespace, engines: int, checkpoint: Path, data: Path, out: Path
) -> float:
    """Median samples/s over `args.rollouts` rollouts (after one warm-up rollout)."""
    config = load_config([
        "--hf-checkpoint", str(checkpoint), "--prompt-data", str(data),
        "--rollout-batch-size", str(args.prompts), "--n-samples-per-prompt", str(args.samples),
        "--rollout-max-response-len", str(args.response_len), "--rm-type", "exact_match",
        "--rollout-num-gpus", str(engines), "--rollout-router", "builtin",
        "--rollout-concurrency", "256", "--output-dir", str(out / f"engines_{engines}"),
    ])  # fmt: skip
    plan = plan_placement(
        actor_num_nodes=1, actor_num_gpus_per_node=1, rollout_num_gpus=engines,
        rollout_num_gpus_per_engine=1, colocate=False, use_gpus=False,
    )  # fmt: skip
    placement = create_placement(plan, timeout_s=120)
    manager = ray.remote(RolloutManager).options(num_cpus=0).remote(config, placement, dp_size=1)
    try:
        ray.get([manager.start_engines.remote(), manager.load_data.remote()])
        ray.get(manager.generate.remote(0))  # warm-up: first-request costs, caches
        rates = []
        for rollout_id in range(1, args.rollouts + 1):
            start = time.perf_counter()
            result = ray.get(manager.generate.remote(rollout_id))
            elapsed = time.perf_counter() - start
            rates.append(result["metrics"]["rollout/samples"] / elapsed)
        return statistics.median(rates)
    finally:
        ray.get(manager.dispose.remote())
        ray.kill(manager)
        remove_placement(placement)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkpoint = build_tiny_checkpoint(root / "ckpt", seed=0)
        data = root / "prompts.jsonl"
        write_prompts(data, 256)
        init_ray(num_cpus=4)
        one = measure(args, 1, checkpoint, data, root)
        two = measure(args, 2, checkpoint, data, root)
        ray.shutdown()
    print(
        f"rollout of {args.prompts} prompts x {args.samples} samples, "
        f"{args.response_len} new tokens max, median of {args.rollouts} rollouts:"
    )
    print(f"  1 engine:                   {one:8.1f} samples/s")
    print(f"  2 engines (least-loaded):   {two:8.1f} samples/s")
    print(f"  speed-up {two / one:.2f}x, scaling efficiency {two / one / 2:.0%}")


if __name__ == "__main__":
    main()
