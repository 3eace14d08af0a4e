"""Output tokens/s of the reference engine against `transformers` `generate`, same model and prompts.

    uv run python bench/engine_throughput.py [--requests 64] [--hidden 256] [--layers 4]

64 concurrent requests of mixed prompt and output lengths go to a `miles-reference-engine`
server (continuous batching: finished sequences leave the batch). `generate` gets the same
prompts left-padded into one batch and must run until the longest output is done. Both count
only the tokens each request asked for, on a tiny Qwen3 built locally, in this one run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM

from miles.backends.sglang_utils.reference_engine.launcher import launch_reference_engine
from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint


def _workload(count: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(0, 256) for _ in range(rng.randint(8, 64))], rng.choice([16, 32, 64, 128]))
        for _ in range(count)
    ]


def run_engine(model_path: Path, workload) -> float:
    with launch_reference_engine(model_path) as url:

        async def send_all() -> float:
            async with httpx.AsyncClient(
                timeout=600, limits=httpx.Limits(max_connections=256)
            ) as client:
                start = time.perf_counter()
                await asyncio.gather(
                    *(
                        client.post(
                            f"{url}/generate",
                            json={
                                "input_ids": prompt,
                                "sampling_params": {
                                    "temperature": 0,
                                    "max_new_tokens": n,
                                    "ignore_eos": True,
                                },
                            },
                        )
                        for prompt, n in workload
                    )
                )
                return time.perf_counter() - start

        return asyncio.run(send_all())


def run_generate(model_path: Path, workload) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    longest = max(len(p) for p, _ in workload)
    input_ids = torch.zeros(len(workload), longest, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, (prompt, _) in enumerate(workload):
        input_ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max(n for _, n in workload),
            min_new_tokens=max(n for _, n in workload),
            pad_token_id=256,
            eos_token_id=None,
        )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    workload = _workload(args.requests, args.seed)
    tokens = sum(n for _, n in workload)
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
        params = sum(
            p.numel() for p in AutoModelForCausalLM.from_pretrained(model_path).parameters()
        )
        print(
            f"model: Qwen3 {params / 1e6:.1f}M params; {args.requests} requests, {tokens} output tokens requested"
        )
        engine_s = run_engine(model_path, workload)
        generate_s = run_generate(model_path, workload)
    print(f"{'method':<40} {'seconds':>9} {'output tok/s':>13}")
    print(
        f"{'miles reference engine (continuous)':<40} {engine_s:>9.2f} {tokens / engine_s:>13.1f}"
    )
    print(
        f"{'transformers generate (padded batch)':<40} {generate_s:>9.2f} {tokens / generate_s:>13.1f}"
    )
    print(f"reference engine / generate: {generate_s / engine_s:.2f}x")


if __name__ == "__main__":
    main()
