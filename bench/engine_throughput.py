"""Output tokens/s of the reference engine against `transformers` `generate`, same model and prompts.

    uv run python bench/engine_throughput.py [--requests 64] [--groups 8] [--group-size 8]

Two workloads, each measured on both in this one run, on a tiny Qwen3 built locally:

- mixed: 64 concurrent requests of mixed prompt and output lengths go to a
  `miles-reference-engine` server (continuous batching: finished sequences leave the batch);
- groups, the RL loop's shape: 8 prompts of 32-64 tokens, each one request for n=8 samples of 16
  tokens (a GRPO group; the engine prefills each prompt once and shares it);
- samples: the same 64 sequences as one request each, as a miles rollout sends them behind a
  router or with a custom generate function (the server parses them one after the other; the
  idle engine waits for the burst, `--admission-quiet-ms`).

`generate` gets the same prompts (a group's repeated n times) left-padded into one batch and must
run until the longest output is done. Both count only the tokens each request asked for. The
engine runs three times: as served, with the Hugging Face forward (`--disable-fast-decode`) and
admitting requests at once (`--admission-quiet-ms 0`), so the script also shows what the engine's
decode step and its wait for a burst are worth.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time

import httpx
import torch
from transformers import AutoModelForCausalLM

from miles.backends.sglang_utils.reference_engine.launcher import launch_reference_engine
from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

Workload = list[tuple[list[int], int, int]]
"""(prompt, max new tokens, samples of it) per request."""


def mixed_workload(count: int, seed: int) -> Workload:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(0, 256) for _ in range(rng.randint(8, 64))],
            rng.choice([16, 32, 64, 128]),
            1,
        )
        for _ in range(count)
    ]


def group_workload(groups: int, group_size: int, seed: int) -> Workload:
    rng = random.Random(seed)
    return [
        ([rng.randrange(0, 256) for _ in range(rng.randint(32, 64))], 16, group_size)
        for _ in range(groups)
    ]


def one_request_per_sample(workload: Workload) -> Workload:
    return [(prompt, new, 1) for prompt, new, samples in workload for _ in range(samples)]


def output_tokens(workload: Workload) -> int:
    return sum(new * samples for _, new, samples in workload)


def run_engine(url: str, workload: Workload) -> float:
    """Seconds until every request of `workload`, sent at once, is answered."""

    async def send_all() -> float:
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            start = time.perf_counter()
            await asyncio.gather(*(
                client.post(f"{url}/generate", json={
                    "input_ids": prompt,
                    "sampling_params": {
                        "temperature": 0, "max_new_tokens": new, "ignore_eos": True, "n": samples,
                    },
                })
                for prompt, new, samples in workload
            ))  # fmt: skip
            return time.perf_counter() - start

    return asyncio.run(send_all())


def step_seconds(url: str) -> dict[str, float]:
    """The engine loop's cumulative time split (its /get_server_info internal state; empty for
    an engine that does not report one)."""
    info = httpx.get(f"{url}/get_server_info", timeout=30).json()
    return info["internal_states"][0].get("step_seconds", {})


def run_generate(model: torch.nn.Module, workload: Workload) -> float:
    rows = [prompt for prompt, _, samples in workload for _ in range(samples)]
    longest = max(len(p) for p in rows)
    input_ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(rows):
        input_ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max(new for _, new, _ in workload),
            min_new_tokens=max(new for _, new, _ in workload),
            pad_token_id=256,
            eos_token_id=None,
        )
    return time.perf_counter() - start


ENGINE = "miles reference engine"
HF_DECODE = "  the same, --disable-fast-decode"
AT_ONCE = "  the same, --admission-quiet-ms 0"
GENERATE = "transformers generate (padded batch)"
# Each engine variant, with its server flags; each serves the same workloads in turn.
ENGINES = {
    ENGINE: (),
    HF_DECODE: ("--disable-fast-decode",),
    AT_ONCE: ("--admission-quiet-ms", "0"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    groups = group_workload(args.groups, args.group_size, args.seed)
    workloads = {
        "mixed": mixed_workload(args.requests, args.seed),
        "groups": groups,
        "samples": one_request_per_sample(groups),
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_path = build_tiny_checkpoint(
            tmp,
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 3,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=args.hidden // 8,
        )
        model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        params = sum(p.numel() for p in model.parameters())
        print(f"model: Qwen3 {params / 1e6:.1f}M params")
        seconds: dict[str, dict[str, float]] = {name: {} for name in workloads}
        splits: dict[str, dict[str, float]] = {}
        for engine, extra_args in ENGINES.items():
            with launch_reference_engine(model_path, extra_args=extra_args) as url:
                for name, workload in workloads.items():
                    before = step_seconds(url)
                    seconds[name][engine] = run_engine(url, workload)
                    after = step_seconds(url)
                    if engine == ENGINE:
                        splits[name] = {k: after[k] - before[k] for k in after}
        for name, workload in workloads.items():
            seconds[name][GENERATE] = run_generate(model, workload)
    print(f"{'workload':<8} {'method':<44} {'seconds':>9} {'output tok/s':>13}")
    for name, by_method in seconds.items():
        tokens = output_tokens(workloads[name])
        for method, taken in by_method.items():
            print(f"{name:<8} {method:<44} {taken:>9.2f} {tokens / taken:>13.1f}")
        generate_s = by_method[GENERATE]
        print(f"{name:<8} reference engine / generate: {generate_s / by_method[ENGINE]:.2f}x "
              f"(with the HF decode forward: {generate_s / by_method[HF_DECODE]:.2f}x, admitting "
              f"at once: {generate_s / by_method[AT_ONCE]:.2f}x)")  # fmt: skip
    print("where the engine's time went (seconds; outside the loop: HTTP, parsing, waiting):")
    for name, split in splits.items():
        engine_s = seconds[name][ENGINE]
        if not split:
            print(f"  {name:<8} (the engine reports no split)")
            continue
        scheduling = split["steps"] - split["prefill"] - split["decode"] - split["sampling"]
        print(f"  {name:<8} prefill {split['prefill']:.2f}, decode forward {split['decode']:.2f}, "
              f"sampling {split['sampling']:.2f}, scheduling {scheduling:.2f}, "
              f"outside the loop {engine_s - split['steps']:.2f} (of {engine_s:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
