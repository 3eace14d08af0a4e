"""LoRA against full fine-tuning on the FSDP backend, side by side in one run: per-rank memory,
step time and weight-sync bytes and seconds, on a random-weight ~330M-parameter Qwen3 on 2 CPU
ranks.

    uv run python bench/lora.py [--steps 2] [--rank 16] [--seq-len 64] [--samples 8]

Each mode runs `FSDPTrainRayActor` on 2 gloo ranks (2 processes, 1 thread each) from the same
checkpoint and batch (SFT loss on the response tokens), and pushes its weights to one running
reference engine (disaggregated: a gloo broadcast group with trainer rank 0):
- full: every weight trains; the sync sends every weight.
- lora merged (--lora-sync merged): adapters on all-linear; the sync sends base + scaling * B @ A
  of the adapted layers only.
- lora adapter (--lora-sync adapter): the same training; the sync writes the PEFT adapter and the
  engine loads it (/load_lora_adapter).
Trainable state is the bytes of gradients and AdamW moments a rank holds right after a step
(local shards); peak RSS is the rank process's maximum resident set (ru_maxrss); step time is
the fastest timed optimizer step; sync seconds the fastest of the timed pushes after a warm-up.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp_train import _free_port, make_batch, state_bytes

from miles.backends.sglang_utils.engine_launcher import EngineLaunchSpec
from miles.backends.sglang_utils.engine_launchers import ReferenceEngineLauncher
from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

# ~331M parameters (tied 32k embeddings), Qwen3 layout: the optimizer dominates full FT's memory.
MODEL = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 24,
         "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64,
         "vocab_size": 32000}  # fmt: skip
MICRO_BATCH = 2
MODES = {
    "full": {},
    "lora merged": {"lora_sync": "merged"},
    "lora adapter": {"lora_sync": "adapter"},
}


def _rank(rank: int, port: int, checkpoint: Path, engine: str, opts: dict, mode: dict, queue):
    from miles.backends.fsdp_utils.actor import FSDPTrainRayActor
    from miles.backends.fsdp_utils.arguments import FSDPArgs
    from miles.backends.training_utils.algorithms.loss_config import LossConfig
    from miles.backends.training_utils.batching.train_batches import get_rollout_data
    from miles.train_backend import TrainRunSpec

    torch.set_num_threads(1)
    os.environ["MILES_DEVICE"] = "cpu"
    spec = TrainRunSpec(
        hf_checkpoint=str(checkpoint), rollout_temperature=1.0, colocate=False,
        global_batch_size=opts["samples"], num_rollout=opts["steps"] + 1, num_steps_per_rollout=1,
    )  # fmt: skip
    lora = {"lora_rank": opts["rank"], "lora_alpha": 2.0 * opts["rank"], **mode} if mode else {}
    fsdp = FSDPArgs(lr=1e-4, micro_batch_size=MICRO_BATCH, seed=0, **lora)
    actor = FSDPTrainRayActor(rank, 2, "127.0.0.1", port)
    actor.init(spec, LossConfig(loss_type="sft_loss"), fsdp)
    model, optimizer = actor.engine.model, actor.engine.optimizer
    memory: dict[str, int] = {}
    optimizer.register_step_post_hook(lambda opt, *_: memory.update(state_bytes(model, opt)))
    shard = get_rollout_data(make_batch(opts["samples"], opts["seq_len"]), rank, 2)
    actor.train(0, shard)  # warm-up: allocations, optimizer state
    step_seconds = []
    for step in range(opts["steps"]):
        dist.barrier()
        start = time.perf_counter()
        actor.train(step + 1, shard)
        dist.barrier()
        step_seconds.append(time.perf_counter() - start)
    weights = actor.engine.adapter_weights if mode.get("lora_sync") == "adapter" else None
    weights = weights or actor.engine.named_weights
    sync_bytes = sum(t.numel() * t.element_size() for _, t in weights())
    actor.connect_engines([engine])
    sync_seconds = []
    for _ in range(opts["sync_repeats"] + 1):  # the first forms the broadcast group
        dist.barrier()
        start = time.perf_counter()
        actor.update_weights()
        dist.barrier()
        sync_seconds.append(time.perf_counter() - start)
    actor.close()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    queue.put((rank, {
        "step_s": min(step_seconds), "trainable_bytes": memory["grads"] + memory["optim"],
        "param_bytes": memory["params"], "peak_rss": peak_rss, "sync_bytes": sync_bytes,
        "sync_s": min(sync_seconds[1:]),
    }))  # fmt: skip
    dist.destroy_process_group()


def run_mode(checkpoint: Path, engine: str, opts: dict, mode: dict) -> list[dict]:
    """Each rank's measurements of one mode."""
    ctx = multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    processes = [
        ctx.Process(target=_rank, args=(r, port, checkpoint, engine, opts, mode, queue))
        for r in range(2)
    ]
    for process in processes:
        process.start()
    results = sorted(queue.get(timeout=3600) for _ in processes)
    for process in processes:
        process.join()
    return [measured for _, measured in results]


def _parameters(checkpoint: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="timed steps (the fastest counts)")
    parser.add_argument("--rank", type=int, default=16, help="--lora-rank")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sample")
    parser.add_argument("--samples", type=int, default=8, help="samples per global batch")
    parser.add_argument("--sync-repeats", type=int, default=2, help="timed weight pushes")
    opts = vars(parser.parse_args())
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_tiny_checkpoint(Path(tmp) / "model", seed=0, **MODEL)
        n_params = _parameters(checkpoint)
        spec = EngineLaunchSpec(
            model_path=str(checkpoint), dtype="float32", enable_lora=True,
            max_lora_rank=opts["rank"], lora_target_modules=["all"],
            log_path=str(Path(tmp) / "engine.log"),
        )  # fmt: skip
        launcher = ReferenceEngineLauncher(spec)
        engine = launcher.start()
        try:
            for name, mode in MODES.items():
                rows[name] = run_mode(checkpoint, engine, opts, mode)
                print(f"measured {name}", flush=True)
        finally:
            launcher.shutdown()
    mib = float(1 << 20)
    print(
        f"\nQwen3 {MODEL['num_hidden_layers']} layers x {MODEL['hidden_size']} "
        f"({n_params / 1e6:.0f}M params), "
        f"2 FSDP ranks on CPU, batch {opts['samples']} x {opts['seq_len']} tokens, LoRA rank "
        f"{opts['rank']} alpha {2 * opts['rank']} on all-linear"
    )
    print(f"{'mode':14} {'step s':>7} {'trainable MiB/rank':>19} {'peak RSS MiB/rank':>18} "
          f"{'sync MiB':>9} {'sync s':>7}")  # fmt: skip
    for name, ranks in rows.items():
        worst = {key: max(r[key] for r in ranks) for key in ranks[0]}
        print(f"{name:14} {worst['step_s']:7.2f} {worst['trainable_bytes'] / mib:19.1f} "
              f"{worst['peak_rss'] / mib:18.0f} {worst['sync_bytes'] / mib:9.2f} "
              f"{worst['sync_s']:7.2f}")  # fmt: skip
    full, merged, adapter = (
        {key: max(r[key] for r in rows[name]) for key in rows[name][0]} for name in MODES
    )
    print(
        f"\nLoRA / full: trainable state {merged['trainable_bytes'] / full['trainable_bytes']:.2%} "
        f"(target <= 5%), step time {merged['step_s'] / full['step_s']:.2f}x (target <= 1), "
        f"peak RSS {merged['peak_rss'] / full['peak_rss']:.2f}x"
    )
    print(
        f"sync bytes / full sync: merged {merged['sync_bytes'] / full['sync_bytes']:.2%}, adapter "
        f"{adapter['sync_bytes'] / full['sync_bytes']:.2%} (target <= 3%); sync seconds: full "
        f"{full['sync_s']:.2f}, merged {merged['sync_s']:.2f}, adapter {adapter['sync_s']:.2f}"
    )


if __name__ == "__main__":
    main()
