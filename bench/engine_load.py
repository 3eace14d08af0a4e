"""The reference engine under load: tokens/s, latency percentiles, memory and threads, round by
round, for this checkout's engine and (with --baseline-rev) an earlier revision's, side by side.

    uv run python bench/engine_load.py [--rounds 5] [--requests 256] [--baseline-rev REV]

Each round sends `--requests` concurrent /generate requests (prompts of 8-64 tokens, 16-64 new
tokens each, seeded) and waits for all. Per round: output tokens/s, p50 and p99 request latency,
the engine's resident memory and thread count after the round. The baseline engine runs from a git
worktree of REV (its sources first on PYTHONPATH) on the same tiny model, one engine at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from miles.backends.sglang_utils.server_process import ServerProcess, free_port
from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]


def workload(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "input_ids": [rng.randrange(0, 256) for _ in range(rng.randint(8, 64))],
            "sampling_params": {
                "max_new_tokens": rng.choice([16, 32, 64]),
                "ignore_eos": True,
                "seed": rng.randrange(1 << 30),
            },
        }
        for _ in range(count)
    ]


async def one_round(url: str, requests: list[dict]) -> tuple[float, list[float], int]:
    """Seconds for the round, each request's latency, output tokens."""
    limits = httpx.Limits(max_connections=len(requests) + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:

        async def timed(body: dict) -> tuple[float, int]:
            start = time.perf_counter()
            answer = await client.post("/generate", json=body)
            answer.raise_for_status()
            return time.perf_counter() - start, len(answer.json()["output_ids"])

        start = time.perf_counter()
        results = await asyncio.gather(*(timed(body) for body in requests))
        elapsed = time.perf_counter() - start
    return elapsed, [latency for latency, _ in results], sum(tokens for _, tokens in results)


def process_figures(pid: int) -> tuple[float, int]:
    """Resident MiB and threads of process `pid` (Linux /proc)."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["Threads"])


@contextmanager
def engine(checkpoint: Path, source: Path | None):
    """A reference engine on loopback; from `source` (a checkout) when given."""
    port = free_port()
    env = None
    if source is not None:
        paths = [str(p) for p in sorted((source / "packages").glob("*/src"))]
        env = {"PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "miles.backends.sglang_utils.reference_engine.cli",
               "--model-path", str(checkpoint), "--port", str(port), "--log-level", "warning",
               "--max-running-requests", "256"]  # fmt: skip
    process = ServerProcess(command, name=f"bench-engine-{port}", env=env)
    try:
        process.wait_until_ready(f"http://127.0.0.1:{port}/health", timeout_s=300)
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        process.shutdown()


def measure(label: str, checkpoint: Path, source: Path | None, args) -> list[dict]:
    rows = []
    with engine(checkpoint, source) as (url, pid):
        asyncio.run(one_round(url, workload(8, seed=99)))  # warm-up
        for round_index in range(args.rounds):
            requests = workload(args.requests, seed=round_index)
            elapsed, latencies, tokens = asyncio.run(one_round(url, requests))
            rss, threads = process_figures(pid)
            cuts = statistics.quantiles(latencies, n=100)
            rows.append({"engine": label, "round": round_index, "tok_s": tokens / elapsed,
                         "p50_s": cuts[49], "p99_s": cuts[98], "rss_mib": rss,
                         "threads": threads})  # fmt: skip
            print(f"{label:>8} round {round_index}: {tokens / elapsed:7.0f} tok/s  "
                  f"p50 {cuts[49]:5.2f} s  p99 {cuts[98]:5.2f} s  RSS {rss:6.0f} MiB  "
                  f"threads {threads}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--baseline-rev", default=None, help="git revision to compare against")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_tiny_checkpoint(Path(tmp) / "ckpt", seed=0)
        engines = [("current", None)]
        if args.baseline_rev:
            worktree = Path(tmp) / "baseline"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree),
                            args.baseline_rev], check=True, capture_output=True)  # fmt: skip
            engines.insert(0, (args.baseline_rev[:10], worktree))
        try:
            rows = [row for label, src in engines for row in measure(label, checkpoint, src, args)]
        finally:
            if args.baseline_rev:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                str(worktree)], check=False)  # fmt: skip
    print("\nmean over rounds (first round included):")
    for label, _ in engines:
        mine = [r for r in rows if r["engine"] == label]
        print(f"{label:>10}: {statistics.mean(r['tok_s'] for r in mine):7.0f} tok/s  "
              f"p50 {statistics.mean(r['p50_s'] for r in mine):5.2f} s  "
              f"p99 {statistics.mean(r['p99_s'] for r in mine):5.2f} s  "
              f"RSS {mine[0]['rss_mib']:.0f} -> {mine[-1]['rss_mib']:.0f} MiB  "
              f"threads {mine[0]['threads']} -> {mine[-1]['threads']}")  # fmt: skip


if __name__ == "__main__":
    main()
