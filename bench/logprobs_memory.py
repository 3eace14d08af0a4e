"""Peak memory and time of chunked `get_log_probs_and_entropy` against plain log_softmax + gather.

    uv run python bench/logprobs_memory.py [--tokens 8192] [--vocab 151936] [--dtype bfloat16]

Both run in this one process on the same bf16 logits (as a model's lm_head emits them). Memory is
the peak resident set above what the process held before the call (Linux VmHWM, reset between
runs through /proc/self/clear_refs), so it counts every temporary the call creates, not the input.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from pathlib import Path

import torch

from miles.backends.training_utils.step.logprobs import get_log_probs_and_entropy

GIB = float(1 << 30)


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status; this benchmark needs Linux")


def measure(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(peak extra GiB, best seconds) of `fn`."""
    best = float("inf")
    peak = 0
    for _ in range(repeats):
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        before = _status_bytes("VmRSS")
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
        peak = max(peak, _status_bytes("VmHWM") - before)
        del result
    return peak / GIB, best


def plain(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_p = torch.log_softmax(logits.float(), dim=-1)
    log_probs = log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return log_probs, entropy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936, help="Qwen2/3 vocabulary size")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    logits = torch.randn(args.tokens, args.vocab, dtype=getattr(torch, args.dtype))
    tokens = torch.randint(0, args.vocab, (args.tokens,))
    print(
        f"logits: {args.tokens} tokens x {args.vocab} vocab, {args.dtype} "
        f"({logits.numel() * logits.element_size() / GIB:.2f} GiB), torch threads: {torch.get_num_threads()}"
    )
    with torch.no_grad():
        chunked_lp, chunked_ent = get_log_probs_and_entropy(
            logits, tokens, chunk_size=args.chunk_size
        )
        plain_lp, plain_ent = plain(logits, tokens)
        torch.testing.assert_close(chunked_lp, plain_lp)
        torch.testing.assert_close(chunked_ent, plain_ent)
        del chunked_lp, chunked_ent, plain_lp, plain_ent
        results = {
            "plain log_softmax + gather": measure(lambda: plain(logits, tokens), args.repeats),
            f"chunked (chunk {args.chunk_size})": measure(
                lambda: get_log_probs_and_entropy(logits, tokens, chunk_size=args.chunk_size),
                args.repeats,
            ),
        }
    print(f"{'method':<30} {'peak extra GiB':>15} {'best seconds':>13}")
    for name, (peak, seconds) in results.items():
        print(f"{name:<30} {peak:>15.3f} {seconds:>13.3f}")
    (plain_peak, plain_s), (chunk_peak, chunk_s) = results.values()
    print(
        f"chunked vs plain: {plain_peak / max(chunk_peak, 1e-9):.1f}x lower peak memory, "
        f"{plain_s / chunk_s:.2f}x the speed (>1 is faster)"
    )


if __name__ == "__main__":
    main()
