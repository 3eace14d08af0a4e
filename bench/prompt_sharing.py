"""Train-step forward and backward of GRPO micro-batches, each prompt forwarded once for its group
(--share-prompt-forward) against once per sample (the padded batch), measured side by side.

    uv run python bench/prompt_sharing.py [--repeats 7] [--threads 1]

Each shape is one micro-batch of `groups` prompts x `samples` responses of random lengths (half
to all of the maximum), through a tiny Qwen3 (the e2e benchmark's: 4 layers, hidden 256) on
sdpa, as the FSDP backend runs it (`packed_logits` at the response positions, or
`shared_prompt_logits`), then a log-softmax loss and its backward. The first shape is
`bench/e2e_vs_trl.py`'s workload; the others show how the gain moves with the prompt's share of
the tokens. Times are the median of `--repeats` after one warm-up; every shape also checks that
both layouts give the same log-probs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from miles.backends.fsdp_utils.modeling import packed_logits, response_positions
from miles.backends.fsdp_utils.prompt_sharing import (
    padded_batch_tokens,
    plan_shared_prompts,
    shared_prompt_logits,
)
from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint
from miles.backends.training_utils.batching.packing import PackedBatch, pack_sequences

SHAPES = [  # (groups, samples per group, prompt tokens, max response tokens)
    (8, 8, 9, 16),
    (4, 8, 128, 32),
    (4, 8, 32, 128),
    (2, 16, 256, 64),
]
CPU = torch.device("cpu")


def grpo_micro_batch(groups: int, samples: int, prompt: int, response: int) -> PackedBatch:
    rng = random.Random(0)
    tokens, lengths = [], []
    for _ in range(groups):
        shared = [rng.randrange(1, 256) for _ in range(prompt)]
        for _ in range(samples):
            length = rng.randint(max(1, response // 2), response)
            tokens.append(shared + [rng.randrange(1, 256) for _ in range(length)])
            lengths.append(length)
    return pack_sequences(tokens, lengths, [[1] * n for n in lengths])


def step_seconds(model, packed: PackedBatch, *, shared: bool, repeats: int):
    positions = response_positions(packed)
    targets = packed.input_ids[0][positions + 1]
    plan = plan_shared_prompts(packed)
    times, log_probs = [], None
    for _ in range(repeats + 1):
        start = time.perf_counter()
        if shared:
            logits = shared_prompt_logits(model, plan, CPU)
        else:
            logits = packed_logits(
                model, packed, attn_implementation="sdpa", device=CPU, positions=positions
            )
        log_probs = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
        log_probs.mean().backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    tokens = plan.num_tokens if shared else padded_batch_tokens(packed)
    return statistics.median(times[1:]), tokens, log_probs.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: as a rank)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_tiny_checkpoint(
            Path(tmp) / "ckpt", seed=0, hidden_size=256, intermediate_size=768,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa")
    model.train()
    print(f"tiny Qwen3 (4 layers, hidden 256), sdpa, {args.threads} thread(s); fwd+bwd per "
          f"micro-batch, median of {args.repeats}")  # fmt: skip
    print(f"{'groups x samples':>17} {'prompt':>6} {'resp<=':>6} | {'tokens per-doc':>14} "
          f"{'shared':>7} | {'ms per-doc':>10} {'shared':>7} {'speed-up':>8}")  # fmt: skip
    for groups, samples, prompt, response in SHAPES:
        packed = grpo_micro_batch(groups, samples, prompt, response)
        per_doc = step_seconds(model, packed, shared=False, repeats=args.repeats)
        shared = step_seconds(model, packed, shared=True, repeats=args.repeats)
        gap = float((per_doc[2] - shared[2]).abs().max())
        assert gap < 1e-4, f"the layouts disagree on log-probs by {gap}"
        print(f"{groups:>8} x {samples:<6} {prompt:>6} {response:>6} | {per_doc[1]:>14} "
              f"{shared[1]:>7} | {per_doc[0] * 1e3:>10.1f} {shared[0] * 1e3:>7.1f} "
              f"{per_doc[0] / shared[0]:>7.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
