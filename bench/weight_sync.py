"""Seconds to push a ~100M-parameter model into a running reference engine through each transport,
next to a plain memory copy of the same bytes, all measured in this one run.

    uv run python bench/weight_sync.py [--buffer-mb 256] [--repeats 3]

Transports: shared-memory tensors (`/update_weights_from_tensor`, colocated) and a gloo broadcast
group with the engine (`/update_weights_from_distributed`, disaggregated). The copy is a
`torch.Tensor.copy_` of every parameter into a preallocated buffer, the floor for any transport.
Each transport's best time is printed beside the copy's (the "x copy" column: the issue's target is
0.5), with the memory each side holds for it: the trainer's staging buffers, and the engine's peak
resident memory during the syncs above what it held before them (its VmHWM, reset first).
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from miles.backends.sglang_utils.client import SyncEngineClient
from miles.backends.sglang_utils.reference_engine.launcher import reference_engine_process
from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint
from miles.backends.sglang_utils.weight_sync import DistributedWeightSender, TensorWeightSender


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _rss_mb(pid: int, field: str) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines()
                if line.startswith(f"{field}:")) / 1024  # fmt: skip


def _engine_peak_above_start(pid: int, sync) -> float:
    """MB the engine's resident memory peaked above its level before `sync()` ran."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    before = _rss_mb(pid, "VmRSS")
    sync()
    return _rss_mb(pid, "VmHWM") - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buffer-mb", type=int, default=256, help="--update-weight-buffer-size")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    max_bytes = args.buffer_mb * 2**20
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(
            tmp,
            hidden_size=768,
            intermediate_size=2560,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            head_dim=64,
            seed=1,
        )
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        params = list(model.named_parameters())
        total_bytes = sum(p.numel() * p.element_size() for _, p in params)
        print(
            f"model: {sum(p.numel() for _, p in params) / 1e6:.1f}M params, {total_bytes / 1e9:.3f} GB fp32, "
            f"bucket {args.buffer_mb} MiB"
        )
        buffer = torch.empty(sum(p.numel() for _, p in params))

        def copy() -> None:
            offset = 0
            for _, p in params:
                buffer[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
                offset += p.numel()

        with reference_engine_process(path) as (url, process), SyncEngineClient(url) as client:
            engine = process.pid
            results = {"memory copy (floor)": _best(copy, args.repeats)}
            staging, engine_peak = {}, {}
            tensor_sender = TensorWeightSender([client], max_bytes=max_bytes, dtype=torch.float32)
            engine_peak["update_weights_from_tensor"] = _engine_peak_above_start(
                engine, lambda: tensor_sender.send(iter(params), weight_version="warm-up")
            )
            results["update_weights_from_tensor"] = _best(
                lambda: tensor_sender.send(iter(params), weight_version="bench"), args.repeats
            )
            staging["update_weights_from_tensor"] = tensor_sender._staging.allocated_bytes
            tensor_sender.close()
            sender = DistributedWeightSender(
                [client],
                master_address="127.0.0.1",
                master_port=_free_port(),
                group_name="bench",
                backend="gloo",
                max_bytes=max_bytes,
                dtype=torch.float32,
            )
            sender.connect()
            try:
                engine_peak["update_weights_from_distributed"] = _engine_peak_above_start(
                    engine, lambda: sender.send(iter(params), weight_version="warm-up")
                )
                results["update_weights_from_distributed"] = _best(
                    lambda: sender.send(iter(params), weight_version="bench"), args.repeats
                )
                staging["update_weights_from_distributed"] = sender._staging.allocated_bytes
            finally:
                sender.close()
    floor = results["memory copy (floor)"]
    print(f"bucket bound: {args.buffer_mb} MiB (--update-weight-buffer-size)")
    print(f"{'transport':<34} {'seconds':>9} {'GB/s':>8} {'x copy':>7} {'trainer MiB':>12} "
          f"{'engine MiB':>11}")  # fmt: skip
    for name, seconds in results.items():
        memory = ""
        if name in staging:
            memory = f" {staging[name] / 2**20:>12.0f} {engine_peak[name]:>11.0f}"
        print(f"{name:<34} {seconds:>9.3f} {total_bytes / seconds / 1e9:>8.2f} "
              f"{floor / seconds:>7.2f}{memory}")  # fmt: skip


if __name__ == "__main__":
    main()
