"""MegatronTrainRayActor's whole life on one GPU: bf16 params with the distributed optimizer, log-probs
equal to the HF model's, train steps, a distributed checkpoint that restores model, optimizer and
schedule exactly, HF export, sleep freeing the device memory, and a weight update from a sleeping
trainer to a real reference engine on the same GPU. Skipped without a GPU; run by the cuda session.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.timeout(600),
]

GLOBAL_BATCH = 4
TEMPERATURE = 0.8
BF16_TOLERANCE = 0.05  # mean |log-prob| gap between bf16 Megatron and float32 HF on a tiny model
PROMPT = [72, 101, 108, 108, 111, 44, 32]  # "Hello, " in the byte tokenizer


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_batch(seed: int, num_samples: int = 2 * GLOBAL_BATCH) -> dict[str, list]:
    rng = random.Random(seed)
    batch: dict[str, list] = {k: [] for k in ("tokens", "response_lengths", "total_lengths")}
    batch.update(loss_masks=[], rewards=[])
    for _ in range(num_samples):
        prompt, response = rng.randint(2, 7), rng.randint(2, 8)
        tokens = [rng.randrange(256) for _ in range(prompt + response)]
        batch["tokens"].append(tokens)
        batch["response_lengths"].append(response)
        batch["total_lengths"].append(len(tokens))
        batch["loss_masks"].append([1] * response)
        batch["rewards"].append(rng.uniform(-1, 1))
    return batch


def hf_rollout_log_probs(model_dir: Path, batch: dict) -> list[list[float]]:
    """What a float32 engine running `model_dir` reports for the batch's response tokens."""
    from transformers import AutoModelForCausalLM

    from miles.backends.training_utils.logprobs import get_log_probs_and_entropy

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    out = []
    for tokens, r in zip(batch["tokens"], batch["response_lengths"], strict=True):
        ids = torch.tensor([tokens], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        lp, _ = get_log_probs_and_entropy(
            logits[len(tokens) - r - 1 : -1], ids[0, len(tokens) - r :], temperature=TEMPERATURE
        )
        out.append(lp.cpu().tolist())
    return out


def with_rollout_log_probs(model_dir: Path, batch: dict) -> dict:
    return {**batch, "rollout_log_probs": hf_rollout_log_probs(model_dir, batch)}


def snapshot(actor) -> dict[str, torch.Tensor]:
    """Parameters, master weights and Adam moments, cloned, keyed by position in the optimizer."""
    state = {f"param/{n}": p.detach().clone() for n, p in actor.model.module.named_parameters()}
    parts = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    for i, part in enumerate(parts):
        inner = part.optimizer
        for j, group in enumerate(inner.param_groups):
            for k, main in enumerate(group["params"]):
                state[f"main/{i}/{j}/{k}"] = main.detach().clone()
                for key, value in inner.state.get(main, {}).items():
                    if isinstance(value, torch.Tensor):
                        state[f"{key}/{i}/{j}/{k}"] = value.detach().clone()
    return state


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@contextlib.contextmanager
def reference_engine(model_path: Path) -> Iterator[str]:
    """A reference engine on this GPU in its own process group; killed at the end."""
    port = free_port()
    command = [sys.executable, "-m", "miles.backends.sglang_utils.reference_engine.cli",
               "--model-path", str(model_path), "--port", str(port), "--dtype", "float32",
               "--log-level", "warning"]  # fmt: skip
    process = subprocess.Popen(command, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            if process.poll() is not None:
                raise RuntimeError(f"the reference engine exited with {process.returncode}")
            time.sleep(0.25)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def engine_vs_trainer(actor, url: str) -> float:
    """Max |engine - trainer| log-prob over a greedy continuation (both at temperature 1)."""
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}}  # fmt: skip
    answer = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    output = answer["output_ids"]
    tokens = PROMPT + output
    batch = {"tokens": [tokens], "response_lengths": [len(output)],
             "total_lengths": [len(tokens)], "loss_masks": [[1] * len(output)]}  # fmt: skip
    trainer = actor._forward_log_probs(actor.model, batch)[0].float().cpu()
    engine = torch.tensor([item[0] for item in answer["meta_info"]["output_token_logprobs"]])
    return float((trainer - engine).abs().max())


@pytest.fixture(scope="module")
def life(tmp_path_factory) -> dict:
    """One actor through its whole life; the tests below read what each stage left behind."""
    import torch.distributed as dist

    from miles.backends.megatron_utils.actor import MegatronTrainRayActor
    from miles.backends.megatron_utils.arguments import MegatronArgs
    from miles.backends.megatron_utils.parallel import destroy_megatron_parallel
    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint
    from miles.backends.training_utils.loss_config import LossConfig

    tmp = tmp_path_factory.mktemp("megatron_actor")
    checkpoint = build_tiny_checkpoint(tmp / "hf", seed=0)
    args = SimpleNamespace(
        hf_checkpoint=str(checkpoint),
        megatron=MegatronArgs(params_dtype="bfloat16", lr=1e-3, seed=0),
        loss=LossConfig(), rollout_temperature=TEMPERATURE, global_batch_size=GLOBAL_BATCH,
        n_samples_per_prompt=4, num_rollout=4, rollout_batch_size=2, save=str(tmp / "save"),
        load=str(tmp / "save"), engine_urls=[], colocate=True,
    )  # fmt: skip
    actor = MegatronTrainRayActor(0, 1, "127.0.0.1", free_port())
    out: dict = {"start": actor.init(args, "actor", with_ref=False)}
    try:
        first = with_rollout_log_probs(checkpoint, make_batch(seed=0))
        out["gap_at_start"] = actor.logprob_gap(first)
        before = snapshot(actor)
        out["metrics"] = actor.train(0, first)
        out["moved"] = max_difference(before, snapshot(actor))

        actor.save_model(0)
        saved = snapshot(actor)
        second = make_batch(seed=1)
        actor.train(1, second)
        uninterrupted = snapshot(actor)
        out["resumed_from"] = actor._resume()
        out["restore_error"] = max_difference(saved, snapshot(actor))
        actor.train(1, second)
        out["resume_vs_uninterrupted"] = max_difference(uninterrupted, snapshot(actor))

        actor.export_hf(tmp / "export")
        out["gap_to_export"] = actor.logprob_gap(
            with_rollout_log_probs(tmp / "export", make_batch(seed=2))
        )

        awake = snapshot(actor)
        allocated = torch.cuda.memory_allocated()
        actor.sleep()
        out["freed"] = allocated - torch.cuda.memory_allocated()
        out["offloaded_bytes"] = actor._offloader.nbytes
        with pytest.raises(RuntimeError, match="while the trainer sleeps"):
            actor.save_model(1)
        # Colocated: the loop updates the engine while the trainer sleeps.
        engine_checkpoint = build_tiny_checkpoint(tmp / "engine", seed=1)  # other weights
        with reference_engine(engine_checkpoint) as url:
            actor.args.engine_urls = [url]
            actor.wake_up()
            out["engine_gap_before"] = _gap_at_temperature_one(actor, url)
            actor.sleep()
            actor.update_weights()
            out["params_freed_after_send"] = all(
                p.untyped_storage().nbytes() == 0 for p in actor.model.module.parameters()
            )
            actor.wake_up()
            out["wake_error"] = max_difference(awake, snapshot(actor))
            out["engine_gap_after"] = _gap_at_temperature_one(actor, url)
        actor.close()
        out["trains_after_wake"] = actor.train(2, make_batch(seed=3))
    finally:
        destroy_megatron_parallel()
        dist.destroy_process_group()
    return out


def _gap_at_temperature_one(actor, url: str) -> float:
    # Greedy engine log-probs are at temperature 1; the trainer's forward follows its config.
    saved = actor.forward.temperature
    actor.forward.temperature = 1.0
    try:
        return engine_vs_trainer(actor, url)
    finally:
        actor.forward.temperature = saved


def test_a_fresh_actor_starts_at_rollout_0_with_the_hf_models_log_probs(life):
    assert life["start"] == 0
    assert life["gap_at_start"] < BF16_TOLERANCE


def test_train_takes_one_step_per_global_batch_and_moves_the_weights(life):
    assert len(life["metrics"]) == 2
    for step in life["metrics"]:
        assert 0 < step["train/grad_norm"] < float("inf")
    assert life["moved"] > 0


def test_a_checkpoint_restores_model_and_optimizer_exactly_and_resumes_like_no_stop(life):
    assert life["resumed_from"] == 1
    assert life["restore_error"] == 0.0
    assert life["resume_vs_uninterrupted"] < 1e-2  # bf16 weights; GPU kernels may reorder sums


def test_the_hf_export_runs_the_trained_weights(life):
    assert life["gap_to_export"] < BF16_TOLERANCE


def test_sleep_frees_the_state_and_wake_brings_it_back_unchanged(life):
    assert life["offloaded_bytes"] > 0
    assert life["freed"] >= 0.9 * life["offloaded_bytes"]
    assert life["wake_error"] == 0.0
    assert life["params_freed_after_send"]  # the weights visited the device for the send only
    assert all(0 < s["train/grad_norm"] < float("inf") for s in life["trains_after_wake"])


def test_a_sleeping_trainer_updates_a_colocated_engine_to_its_weights(life):
    assert life["engine_gap_before"] > 1e-2, "the engine must start from other weights"
    assert life["engine_gap_after"] < BF16_TOLERANCE
