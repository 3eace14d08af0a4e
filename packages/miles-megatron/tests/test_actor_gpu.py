"""MegatronTrainRayActor's whole life on one GPU: bf16 params with the distributed optimizer, log-probs
equal to the HF model's, train steps, a distributed checkpoint that restores model, optimizer and
schedule exactly, HF export, sleep freeing the device memory, and a weight update from a sleeping
trainer to a real reference engine on the same GPU (one GPU: NCCL cannot pair two ranks on one
device, so the broadcast transport is covered on CPU by test_actor.py). Skipped without a GPU; run
by the cuda session.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import free_port

from .actor_lifecycle import (
    engine_vs_trainer,
    make_args,
    make_batch,
    max_difference,
    point_at_engine,
    reference_engine,
    snapshot,
    weights_of,
    with_rollout_log_probs,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.timeout(600),
]

BF16_TOLERANCE = 0.05  # |log-prob| gap between bf16 Megatron and float32 HF on a tiny model
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def life(tmp_path_factory) -> dict:
    """One actor through its whole life; the tests below read what each stage left behind."""
    import torch.distributed as dist

    from miles.backends.megatron_utils.actor import MegatronTrainRayActor
    from miles.backends.megatron_utils.parallel import destroy_megatron_parallel
    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("megatron_actor")
    checkpoint = build_tiny_checkpoint(tmp / "hf", seed=0)
    args = make_args(checkpoint, tmp / "save", params_dtype="bfloat16")
    actor = MegatronTrainRayActor(0, 1, "127.0.0.1", free_port())
    out: dict = {"start": args.init(actor)}
    try:
        first = with_rollout_log_probs(checkpoint, make_batch(seed=0), CUDA)
        out["gap_at_start"] = actor.logprob_gap(first)
        before = snapshot(actor)
        out["metrics"] = actor.train(0, first)
        out["moved"] = max_difference(weights_of(before), weights_of(snapshot(actor)))

        actor.save_model(0)
        saved = snapshot(actor)
        actor.train(1, make_batch(seed=1))
        uninterrupted = snapshot(actor)
        out["resumed_from"] = actor._resume()
        out["restore_error"] = max_difference(saved, snapshot(actor))
        actor.train(1, make_batch(seed=1))
        out["resume_vs_uninterrupted"] = max_difference(uninterrupted, snapshot(actor))

        actor.export_hf(tmp / "export")
        out["gap_to_export"] = actor.logprob_gap(
            with_rollout_log_probs(tmp / "export", make_batch(seed=2), CUDA)
        )

        engine_checkpoint = build_tiny_checkpoint(tmp / "engine", seed=1)  # other weights
        with reference_engine(engine_checkpoint, "cuda") as url:
            point_at_engine(actor, url)
            out["engine_gap_before"] = engine_vs_trainer(actor, url)["diff"]
            awake = snapshot(actor)
            allocated = torch.cuda.memory_allocated()
            actor.sleep()
            # Allocated, not reserved: a tiny model's tensors share the allocator's small-block
            # segments with live tensors, so only a real model's buffers give whole segments back.
            out["freed"] = allocated - torch.cuda.memory_allocated()
            out["offloaded_bytes"] = actor.engine._offloader.nbytes
            with pytest.raises(RuntimeError, match="while the trainer sleeps"):
                actor.save_model(1)
            actor.update_weights()  # colocated: CUDA IPC, from the sleeping trainer
            out["params_freed_after_send"] = all(
                p.untyped_storage().nbytes() == 0 for p in actor.engine.model.module.parameters()
            )
            actor.wake_up()
            out["wake_error"] = max_difference(awake, snapshot(actor))
            out["engine_gap_after"] = engine_vs_trainer(actor, url)["diff"]
        actor.close()
        out["trains_after_wake"] = actor.train(2, make_batch(seed=3))
    finally:
        destroy_megatron_parallel()
        dist.destroy_process_group()
    return out


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
