"""Weight sync from FSDP ranks to a real reference engine on loopback: after an update the
engine's log-probs on a fixed sequence equal the trainer's (the step-0 check, architecture.md:
"The loop"), through shared memory (colocated) and through a gloo broadcast group
(disaggregated)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from .distributed import run_distributed
from .test_actor import build_checkpoint, free_port, local_shard, make_actor, make_args, make_batch

PROMPT = [72, 101, 108, 108, 111, 44, 32]  # "Hello, " in the byte tokenizer
# Smaller than the embedding (259 x 64 float32 = 66 KiB): the update travels in many buckets.
BUFFER_BYTES = 48 << 10


@contextlib.contextmanager
def engine_process(model_path: Path, *flags: str) -> Iterator[str]:
    """A `miles-reference-engine` (with `flags`) on a free loopback port; yields its URL at once
    (the caller waits for /health), and kills its process group at the end."""
    port = free_port()
    script = Path(sys.prefix) / "bin" / "miles-reference-engine"
    command = [str(script), "--model-path", str(model_path), "--port", str(port),
               "--dtype", "float32", "--log-level", "warning", *flags]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def wait_healthy(url: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.25)
    raise TimeoutError(f"engine at {url} not healthy after {timeout_s} s")


def engine_vs_trainer(actor, url: str, rank: int) -> dict:
    """Greedy-decode on the engine, score the same tokens on the trainer (every rank joins)."""
    import torch.distributed as dist

    answer = [None]
    if rank == 0:
        body = {"input_ids": PROMPT, "return_logprob": True,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}}  # fmt: skip
        answer[0] = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    dist.broadcast_object_list(answer, src=0)  # the trainer forward is a collective
    output, meta = answer[0]["output_ids"], answer[0]["meta_info"]
    tokens = PROMPT + output
    batch = {"tokens": [tokens], "response_lengths": [len(output)],
             "total_lengths": [len(tokens)], "loss_mask": [[1] * len(output)]}  # fmt: skip
    trainer = actor.trainer.log_probs(batch)[0]
    engine = torch.tensor([item[0] for item in meta["output_token_logprobs"]])
    return {"diff": float((trainer - engine).abs().max()), "version": meta["weight_version"]}


def _push_both_ways(rank: int, checkpoint: Path, url: str) -> dict:
    args = make_args(checkpoint, update_weight_buffer_size=BUFFER_BYTES)
    # Greedy log-probs are at T = 1.
    args = args.with_paths(rollout_temperature=1.0)
    actor, _ = make_actor(rank, 2, args)
    actor.connect_engines([url])
    if rank == 0:
        wait_healthy(url)
    results = {"before": engine_vs_trainer(actor, url, rank)}
    actor.update_weights()  # colocated: shared memory
    results["tensor"] = engine_vs_trainer(actor, url, rank)
    actor.train(0, local_shard(make_batch(), rank, 2))  # new weights for the second transport
    actor.close()
    actor.spec = dataclasses.replace(actor.spec, colocate=False)
    actor.update_weights()  # disaggregated: broadcast over gloo
    results["distributed"] = engine_vs_trainer(actor, url, rank)
    actor.close()
    return results


@pytest.mark.parametrize("architecture", ["qwen3", "qwen3_moe"])
def test_engine_log_probs_equal_the_trainers_after_each_transport(tmp_path, architecture):
    """For Qwen3-MoE the experts travel per expert, as SGLang's loaders read them."""
    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

    def build(path: Path, seed: int) -> Path:
        return build_tiny_checkpoint(path, seed=seed, architecture=architecture)

    trainer_checkpoint = build(tmp_path / "trainer", seed=0)
    engine_checkpoint = build(tmp_path / "engine", seed=1)  # other weights at start
    with engine_process(engine_checkpoint) as url:
        rank0 = run_distributed(_push_both_ways, 2, trainer_checkpoint, url, timeout_s=300)[0]
    assert rank0["before"]["diff"] > 1e-2, "the engine must start from other weights"
    assert rank0["tensor"]["diff"] < 1e-5, rank0
    assert rank0["tensor"]["version"] == "1"
    assert rank0["distributed"]["diff"] < 1e-5, rank0
    assert rank0["distributed"]["version"] == "2"


def test_full_tensors_come_once_per_parameter_in_the_engine_dtype_without_rotary_buffers(tmp_path):
    from transformers import AutoModelForCausalLM

    from miles.backends.fsdp_utils.update_weight_utils import iter_full_tensors

    model = AutoModelForCausalLM.from_pretrained(build_checkpoint(tmp_path / "ckpt"))
    pairs = list(iter_full_tensors(model, torch.bfloat16))
    names = [name for name, _ in pairs]
    assert names == [name for name, _ in model.named_parameters()]  # tied lm_head comes once
    assert all(t.dtype == torch.bfloat16 for _, t in pairs)
    assert "model.rotary_emb.inv_freq" not in names


def test_an_update_without_engines_is_refused_naming_the_flag():
    from miles.backends.fsdp_utils.update_weight_utils import iter_full_tensors
    from miles.backends.sglang_utils.weight_sync import UpdateWeightFromTensor

    def linear_tensors():
        return iter_full_tensors(torch.nn.Linear(2, 2), torch.float32)

    with pytest.raises(ValueError, match="--engine-urls"):
        UpdateWeightFromTensor(linear_tensors, [], buffer_size=1 << 20, dtype=torch.float32)
    with pytest.raises(ValueError, match="--update-weight-buffer-size"):
        UpdateWeightFromTensor(linear_tensors, [object()], buffer_size=0, dtype=None)
