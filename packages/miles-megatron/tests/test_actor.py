"""MegatronTrainRayActor's whole life on 2 gloo processes (tensor parallel 2, pipeline parallel 2,
then context parallel 2; float32, the distributed optimizer) through the training CPU shim: log-probs equal the HF model's, train steps,
a distributed checkpoint that restores model, optimizer and schedule exactly (also into a fresh
actor), HF export, sleep / wake-up, and weight updates to a real reference engine through both
transports, the shared-memory one from a sleeping trainer."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from miles.utils.checkpoint_layout import checkpoint_problems, iteration_dir
from miles.utils.run_dirs import RunDirectoryError, checkpoint_to_resume
from tests.support.distributed import free_port

from .actor_lifecycle import (
    TEMPERATURE,
    differing,
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
from .cpu_shim import install_megatron_training_cpu_shim, run_distributed

CPU = torch.device("cpu")
WORLD = 2
SETTINGS = {"params_dtype": "float32", "make_vocab_size_divisible_by": 8,
            "update_weight_buffer_size": 48 << 10}  # fmt: skip
LAYOUTS = {"tp2": {"tensor_model_parallel_size": 2}, "pp2": {"pipeline_model_parallel_size": 2},
           "cp2": {"context_parallel_size": 2}}  # fmt: skip


def _actor(rank: int, checkpoint: Path, save_dir: Path, layout: dict):
    import miles.backends.megatron_utils.actor as actor_module

    install_megatron_training_cpu_shim()
    actor_module.require_gpu = lambda: None  # the backend refuses CPU machines; the shim is why
    actor = actor_module.MegatronTrainRayActor(rank, WORLD, "127.0.0.1", free_port())
    args = make_args(checkpoint, save_dir, **SETTINGS, **layout)
    start = args.init(actor)
    return actor, start


def _life(rank: int, checkpoint: Path, save_dir: Path, layout: dict, url: str) -> dict:
    from transformers import AutoModelForCausalLM

    from tests.support.rollout_batches import reference_scored, scored_forward, with_scored_ids

    actor, start = _actor(rank, checkpoint, save_dir, layout)
    out: dict = {"start": start}
    # The log-probs of K given ids per response position (--opd-kl-mode topk's teacher tokens),
    # and the response's beside them, equal a float64 forward of the start checkpoint.
    micro = with_scored_ids(make_batch(seed=4, num_samples=3), 3, seed=4)
    got = scored_forward(actor.engine, micro)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
    want = reference_scored(hf, micro, TEMPERATURE)
    out["scored_gap"] = max(float((got[k] - want[k]).abs().max()) for k in want)
    out["gap_at_start"] = actor.logprob_gap(
        with_rollout_log_probs(checkpoint, make_batch(seed=0), CPU)
    )
    before = snapshot(actor)
    out["metrics"] = actor.train(0, make_batch(seed=0))
    out["moved"] = max_difference(weights_of(before), weights_of(snapshot(actor)))

    actor.save_model(0)
    out["saved"] = snapshot(actor)
    actor.train(1, make_batch(seed=1))
    uninterrupted = snapshot(actor)
    out["resumed_from"] = actor._resume()
    restored = snapshot(actor)
    out["restore_error"] = max_difference(out["saved"], restored)
    out["restore_differs"] = differing(out["saved"], restored)[:5]
    actor.train(1, make_batch(seed=1))
    out["resume_vs_uninterrupted"] = max_difference(uninterrupted, snapshot(actor))

    actor.export_hf(save_dir / "export")
    out["gap_to_export"] = actor.logprob_gap(
        with_rollout_log_probs(save_dir / "export", make_batch(seed=2), CPU)
    )

    point_at_engine(actor, url)
    out["engine_before"] = engine_vs_trainer(actor, url)
    awake = snapshot(actor)
    actor.sleep()
    out["freed"] = all(
        p.untyped_storage().nbytes() == 0 for p in actor.engine.model.module.parameters()
    )
    try:
        actor.save_model(1)
    except RuntimeError as error:
        out["save_while_asleep"] = str(error)
    actor.update_weights()  # colocated: shared memory, from the sleeping trainer
    out["freed_after_send"] = all(
        p.untyped_storage().nbytes() == 0 for p in actor.engine.model.module.parameters()
    )
    actor.wake_up()
    out["wake_error"] = max_difference(awake, snapshot(actor))
    out["engine_after_tensor"] = engine_vs_trainer(actor, url)

    out["trains_after_wake"] = actor.train(2, make_batch(seed=3))
    actor.close()
    point_at_engine(actor, url, colocate=False)
    actor.update_weights()  # disaggregated: a broadcast group to the engine
    out["engine_after_distributed"] = engine_vs_trainer(actor, url)
    actor.close()
    return out


def _fresh_resume(rank: int, checkpoint: Path, save_dir: Path, layout: dict) -> dict:
    actor, start = _actor(rank, checkpoint, save_dir, layout)
    return {"start": start, "state": snapshot(actor)}


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """One reference engine for every layout (starting one costs ~20 s of imports here), and the
    checkpoint it starts from: other weights than the trainers', so the first check sees a gap."""
    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

    start = build_tiny_checkpoint(tmp_path_factory.mktemp("engine"), seed=1)
    with reference_engine(start, "cpu") as url:
        yield url, start


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def life(request, tmp_path_factory, engine) -> dict:
    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

    url, engine_start = engine
    # Each layout meets the engine as a new run would: holding its own start weights, not the
    # weights the previous layout pushed.
    reset = httpx.post(
        f"{url}/update_weights_from_disk", json={"model_path": str(engine_start)}, timeout=120
    )
    assert reset.status_code == 200, reset.text
    tmp = tmp_path_factory.mktemp("megatron_actor")
    checkpoint = build_tiny_checkpoint(tmp / "hf", seed=0)
    save_dir, layout = tmp / "save", LAYOUTS[request.param]
    ranks = run_distributed(_life, WORLD, checkpoint, save_dir, layout, url, timeout_s=420)
    # The pointer names rollout 0 (the one save); a new process resumes from it. Checked for tp2
    # only (each run costs ~15 s); every layout restores its files in-process in `_life`.
    fresh = None
    if request.param == "tp2":
        fresh = run_distributed(_fresh_resume, WORLD, checkpoint, save_dir, layout, timeout_s=240)
    return {"ranks": ranks, "fresh": fresh, "save_dir": save_dir}


def test_a_fresh_actor_starts_at_rollout_0_with_the_hf_models_log_probs(life):
    for rank in life["ranks"]:
        assert rank["scored_gap"] < 1e-4, "log-probs of the scored ids differ from HF's"
        assert rank["start"] == 0
        assert rank["gap_at_start"] < 1e-5


def test_train_takes_one_step_per_global_batch_with_the_same_metrics_on_every_rank(life):
    rank0, rank1 = life["ranks"]
    assert [m["train/step"] for m in rank0["metrics"]] == [1.0, 2.0]
    assert "train/pg_loss" in rank0["metrics"][0]  # also on a first pipeline stage
    assert rank0["metrics"] == rank1["metrics"]  # both ranks hold one model replica
    assert all(0 < m["train/grad_norm"] < float("inf") for m in rank0["metrics"])
    assert rank0["moved"] > 0


def test_a_checkpoint_restores_model_and_optimizer_exactly_and_resumes_like_no_stop(life):
    for rank in life["ranks"]:
        assert rank["resumed_from"] == 1
        assert rank["restore_error"] == 0.0, rank["restore_differs"]
        assert rank["resume_vs_uninterrupted"] < 1e-6


@pytest.mark.parametrize("life", ["tp2"], indirect=True)
def test_a_new_process_resumes_after_the_saved_rollout_with_the_saved_state(life):
    for saved, fresh in zip(life["ranks"], life["fresh"], strict=True):
        assert fresh["start"] == 1
        assert max_difference(saved["saved"], fresh["state"]) == 0.0


def test_a_truncated_distributed_checkpoint_file_is_found_before_loading_naming_it(life, tmp_path):
    save = tmp_path / "save"
    shutil.copytree(life["save_dir"], save)
    assert checkpoint_problems(save, 0) == [], "the manifest covers every rank's files"
    dist_files = sorted((iteration_dir(save, 0) / "dist").rglob("*.distcp"))
    assert dist_files, "Megatron wrote its shards under dist/"
    shard = max(dist_files, key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(RunDirectoryError, match=f"{shard} has 100 bytes"):
        checkpoint_to_resume(str(save), None)  # an explicit --load
    # Its own --save with no earlier checkpoint: stopped, not started fresh.
    with pytest.raises(RunDirectoryError, match="holds no usable checkpoint"):
        checkpoint_to_resume(str(save), str(save))


def test_the_hf_export_runs_the_trained_weights(life):
    assert all(rank["gap_to_export"] < 1e-5 for rank in life["ranks"])


def test_sleep_frees_the_weights_and_wake_brings_back_everything_unchanged(life):
    for rank in life["ranks"]:
        assert rank["freed"] and rank["freed_after_send"]
        assert "while the trainer sleeps" in rank["save_while_asleep"]
        assert rank["wake_error"] == 0.0
        assert all(0 < m["train/grad_norm"] < float("inf") for m in rank["trains_after_wake"])


def test_the_engine_runs_the_trainers_weights_after_each_transport(life):
    rank0 = life["ranks"][0]
    assert rank0["engine_before"]["diff"] > 1e-2, "the engine must start from other weights"
    assert rank0["engine_after_tensor"]["diff"] < 1e-5, rank0["engine_after_tensor"]
    assert rank0["engine_after_tensor"]["version"] == "1"
    assert rank0["engine_after_distributed"]["diff"] < 1e-5, rank0["engine_after_distributed"]
    assert rank0["engine_after_distributed"]["version"] == "2"
