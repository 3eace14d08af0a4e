"""Training tokens/s and per-rank state memory of the FSDP backend against a plain transformers
loop, on a ~20M-parameter Qwen3-shaped model, all measured in this one run.

    uv run python bench/fsdp_train.py [--steps 3] [--seq-len 256] [--samples 16]

FSDP: `FSDPTrainRayActor` on 2 gloo ranks (2 processes, 1 thread each), and on 1 rank for the
memory table. Plain: one process, 2 threads, `AutoModelForCausalLM` + AdamW on the same batch,
micro-batches and loss (SFT on the response tokens). Memory is the bytes of parameters, gradients
and AdamW state held by a rank, summed over the tensors' local shards right after a step.
Tokens/s come from the fastest of the timed steps: other load on a shared machine only slows
steps down, and a 2-thread OpenMP team suffers most from it (one preempted thread stalls both).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

# ~20.8M parameters (tied embeddings), Qwen3 layout.
MODEL = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 7,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}  # fmt: skip
MICRO_BATCH = 2
PROMPT_TOKENS = 32


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_batch(samples: int, seq_len: int) -> dict[str, list]:
    rng = random.Random(0)
    response = seq_len - PROMPT_TOKENS
    return {
        "tokens": [[rng.randrange(256) for _ in range(seq_len)] for _ in range(samples)],
        "response_lengths": [response] * samples,
        "total_lengths": [seq_len] * samples,
        "loss_mask": [[1] * response for _ in range(samples)],
        "rewards": [0.0] * samples,
    }


def _tensor_bytes(tensor: torch.Tensor) -> int:
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this process holds for parameters, gradients and optimizer state (local shards)."""
    params = list(model.parameters())
    optim = sum(
        _tensor_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    return {
        "params": sum(_tensor_bytes(p) for p in params),
        "grads": sum(_tensor_bytes(p.grad) for p in params if p.grad is not None),
        "optim": optim,
    }


def _fsdp_rank(rank: int, world_size: int, port: int, checkpoint: Path, opts: dict, queue) -> None:
    from miles.backends.fsdp_utils.actor import FSDPTrainRayActor
    from miles.backends.fsdp_utils.arguments import FSDPArgs
    from miles.backends.training_utils.algorithms.loss_config import LossConfig
    from miles.backends.training_utils.batching.train_batches import get_rollout_data
    from miles.train_backend import TrainRunSpec

    torch.set_num_threads(1)
    os.environ["MILES_DEVICE"] = "cpu"
    spec = TrainRunSpec(
        hf_checkpoint=str(checkpoint), rollout_temperature=1.0,
        global_batch_size=opts["samples"], num_rollout=opts["steps"] + 1, num_steps_per_rollout=1,
    )  # fmt: skip
    fsdp = FSDPArgs(lr=1e-4, micro_batch_size=MICRO_BATCH, seed=0)
    actor = FSDPTrainRayActor(rank, world_size, "127.0.0.1", port)
    actor.init(spec, LossConfig(loss_type="sft_loss"), fsdp)
    engine = actor.engine
    memory: dict[str, int] = {}
    engine.optimizer.register_step_post_hook(
        lambda opt, *_: memory.update(state_bytes(engine.model, opt))
    )
    shard = get_rollout_data(make_batch(opts["samples"], opts["seq_len"]), rank, world_size)
    actor.train(0, shard)  # warm-up: allocations, optimizer state
    seconds = []
    for step in range(opts["steps"]):
        dist.barrier()
        start = time.perf_counter()
        actor.train(step + 1, shard)  # one optimizer step: the shard is one global batch
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    queue.put((rank, min(seconds), memory))
    dist.destroy_process_group()


def run_fsdp(world_size: int, checkpoint: Path, opts: dict) -> tuple[float, dict[str, int]]:
    """(seconds of the fastest step, rank 0's state bytes) of `world_size` FSDP ranks."""
    ctx = multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    processes = [
        ctx.Process(target=_fsdp_rank, args=(r, world_size, port, checkpoint, opts, queue))
        for r in range(world_size)
    ]
    for process in processes:
        process.start()
    results = sorted(queue.get(timeout=1800) for _ in processes)
    for process in processes:
        process.join()
    return max(seconds for _, seconds, _ in results), results[0][2]


def run_plain(checkpoint: Path, opts: dict, threads: int) -> tuple[float, dict[str, int]]:
    """A textbook single-process loop on the same batch: micro-batches, SFT loss, AdamW."""
    from miles.backends.training_utils.step.logprobs import get_log_probs_and_entropy

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = make_batch(opts["samples"], opts["seq_len"])
    tokens = torch.tensor(batch["tokens"])  # (N, L)

    def step() -> dict[str, int]:
        for start in range(0, len(tokens), MICRO_BATCH):
            ids = tokens[start : start + MICRO_BATCH]  # (B, L)
            logits = model(input_ids=ids).logits[:, PROMPT_TOKENS - 1 : -1]  # (B, R, V)
            targets = ids[:, PROMPT_TOKENS:]  # (B, R)
            log_probs, _ = get_log_probs_and_entropy(logits.flatten(0, 1), targets.flatten())
            (-log_probs.sum() / targets.numel() * MICRO_BATCH / len(tokens)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        memory = state_bytes(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        return memory

    step()  # warm-up
    seconds = []
    for _ in range(opts["steps"]):
        start = time.perf_counter()
        memory = step()
        seconds.append(time.perf_counter() - start)
    return min(seconds), memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps (the fastest counts)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sample")
    parser.add_argument("--samples", type=int, default=16, help="samples per global batch")
    opts = vars(parser.parse_args())
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_tiny_checkpoint(Path(tmp) / "model", seed=0, **MODEL)
        n_params = sum(
            p.numel() for p in AutoModelForCausalLM.from_pretrained(checkpoint).parameters()
        )
        print(f"model: {n_params / 1e6:.1f}M parameters; batch {opts['samples']} x {opts['seq_len']} tokens, "
              f"micro-batch {MICRO_BATCH}, {opts['steps']} timed steps")  # fmt: skip
        rows = {"plain (1 process, 2 threads)": run_plain(checkpoint, opts, threads=2)}
        rows["plain (1 process, 1 thread)"] = run_plain(checkpoint, opts, threads=1)
        rows["fsdp 1 rank (1 thread)"] = run_fsdp(1, checkpoint, opts)
        rows["fsdp 2 ranks (1 thread each)"] = run_fsdp(2, checkpoint, opts)
    tokens = opts["samples"] * opts["seq_len"]  # per optimizer step
    mib = float(1 << 20)
    print(
        f"{'run':32} {'tokens/s':>9} {'params':>8} {'grads':>8} {'optim':>8} {'total MiB/rank':>15}"
    )
    for name, (seconds, mem) in rows.items():
        total = sum(mem.values())
        print(f"{name:32} {tokens / seconds:9.0f} {mem['params'] / mib:8.1f} "
              f"{mem['grads'] / mib:8.1f} {mem['optim'] / mib:8.1f} {total / mib:15.1f}")  # fmt: skip
    fsdp = tokens / rows["fsdp 2 ranks (1 thread each)"][0]
    for name in ("plain (1 process, 2 threads)", "plain (1 process, 1 thread)"):
        print(f"fsdp 2 ranks / {name}: {fsdp / (tokens / rows[name][0]):.2f}x tokens/s")


if __name__ == "__main__":
    main()
