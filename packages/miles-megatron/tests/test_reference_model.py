"""The Megatron reference model on 2 gloo ranks (tensor parallel 2, float32) through the training
CPU shim: --ref-load builds it from another checkpoint than the policy's (its log-probs are that
checkpoint's, also for another architecture), and --ref-update-interval K makes each rank's slices
an exact copy of the policy's after every K-th rollout, and only then; a reference of another
architecture cannot take the policy's weights, which --ref-update-interval then says."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.support.distributed import free_port

from .actor_lifecycle import make_args, make_batch, with_rollout_log_probs
from .cpu_shim import install_megatron_training_cpu_shim, run_distributed

CPU = torch.device("cpu")
WORLD = 2
SETTINGS = {"params_dtype": "float32", "make_vocab_size_divisible_by": 8,
            "tensor_model_parallel_size": 2}  # fmt: skip
OTHER_ARCHITECTURE = {"intermediate_size": 256, "num_hidden_layers": 3}


def _actor(rank: int, policy: Path, save_dir: Path, reference: Path, interval: int):
    import miles.backends.megatron_utils.actor as actor_module
    from miles.backends.training_utils.algorithms.loss_config import LossConfig

    actor_module.require_gpu = lambda: None  # the backend refuses CPU machines; the shim is why
    actor = actor_module.MegatronTrainRayActor(rank, WORLD, "127.0.0.1", free_port())
    args = make_args(policy, save_dir, **SETTINGS)
    args = dataclasses.replace(
        args,
        spec=dataclasses.replace(args.spec, ref_load=str(reference), ref_update_interval=interval),
        loss=LossConfig(use_kl_loss=True, kl_loss_coef=0.1),
    )
    args.init(actor)
    return actor


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _life(rank: int, policy: Path, save_dir: Path, reference: Path, other: Path) -> dict:
    from miles.backends.megatron_utils.parallel import destroy_megatron_parallel

    install_megatron_training_cpu_shim()
    actor = _actor(rank, policy, save_dir, reference, interval=2)
    engine, batch = actor.engine, make_batch(seed=0)

    def state() -> dict:
        return {
            "reference": [lp.tolist() for lp in actor.trainer.log_probs(batch, reference=True)],
            "policy": [lp.tolist() for lp in actor.trainer.log_probs(batch)],
            "reference_weights": _weights(engine.ref_model),
            "policy_weights": _weights(engine.model.module),
        }

    out = {"loaded": state()}
    actor.train(0, batch)  # rollout 0 of an interval of 2: no copy
    out["first"] = state()
    actor.train(1, make_batch(seed=1))  # the 2nd rollout: the policy is copied
    out["second"] = state()

    # The same processes, a new actor: a reference of another architecture than the policy's.
    destroy_megatron_parallel()
    actor = _actor(rank, policy, save_dir, other, interval=1)
    out["other_loaded"] = [lp.tolist() for lp in actor.trainer.log_probs(batch, reference=True)]
    try:
        actor.train(0, batch)
    except ValueError as error:
        out["other_error"] = str(error)
    return out


@pytest.fixture(scope="module")
def life(tmp_path_factory) -> dict:
    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("megatron_reference")
    paths = {
        "policy": build_tiny_checkpoint(tmp / "policy", seed=0),
        "reference": build_tiny_checkpoint(tmp / "reference", seed=1),
        "other": build_tiny_checkpoint(tmp / "other", seed=2, **OTHER_ARCHITECTURE),
    }
    ranks = run_distributed(
        _life, WORLD, paths["policy"], tmp / "save", paths["reference"], paths["other"],
        timeout_s=420,
    )  # fmt: skip
    batch = make_batch(seed=0)
    hf = {
        name: with_rollout_log_probs(path, batch, CPU)["rollout_log_probs"]
        for name, path in paths.items()
    }
    return {"ranks": ranks, "hf": hf, "paths": paths}


def _assert_log_probs(got: list[list[float]], want: list[list[float]]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=1e-4, rtol=0)


def test_ref_load_gives_the_reference_that_checkpoints_log_probs(life):
    hf = life["hf"]
    for rank in life["ranks"]:
        loaded = rank["loaded"]
        _assert_log_probs(loaded["reference"], hf["reference"])  # --ref-load's checkpoint
        _assert_log_probs(loaded["policy"], hf["policy"])
        differences = [
            (torch.tensor(r) - torch.tensor(p)).abs().max()
            for r, p in zip(loaded["reference"], loaded["policy"], strict=True)
        ]
        assert max(differences) > 1e-2, "the reference must not be the policy's checkpoint"


def test_ref_update_interval_copies_each_ranks_policy_slices_after_every_kth_rollout(life):
    for index, rank in enumerate(life["ranks"]):
        loaded, first, second = rank["loaded"], rank["first"], rank["second"]
        # Rollout 0 of an interval of 2: the reference stays --ref-load's.
        assert first["reference"] == loaded["reference"], f"rank {index}: copied before rollout 2"
        assert all(
            torch.equal(w, loaded["reference_weights"][name])
            for name, w in first["reference_weights"].items()
        )
        assert first["policy"] != loaded["policy"], "rollout 0 trained"
        # Rollout 1: the reference is now the policy, exactly, slice for slice.
        assert second["policy"] != first["policy"], "rollout 1 trained"
        assert second["reference"] == second["policy"], f"rank {index}: not an exact copy"
        policy = second["policy_weights"]
        assert second["reference_weights"].keys() == policy.keys()
        for name, weight in second["reference_weights"].items():
            assert torch.equal(weight, policy[name]), f"rank {index}: {name} differs"
    # Each rank holds (and copied) its own tensor-parallel slices, not a replica of the model.
    slices = [rank["second"]["reference_weights"] for rank in life["ranks"]]
    sharded = [name for name in slices[0] if "linear_fc1" in name]
    assert sharded and not any(torch.equal(slices[0][n], slices[1][n]) for n in sharded)


def test_a_reference_of_another_architecture_loads_but_cannot_take_the_policys_weights(life):
    for rank in life["ranks"]:
        _assert_log_probs(rank["other_loaded"], life["hf"]["other"])
        error = rank["other_error"]
        assert "--ref-update-interval" in error and "another architecture" in error, error
        assert str(life["paths"]["other"]) in error


def test_a_reference_with_another_vocabulary_is_refused(tmp_path):
    from miles.backends.megatron_utils.engine import _reference_config
    from miles.backends.sglang_utils.tiny_checkpoint import tiny_qwen3_config

    policy = tiny_qwen3_config()
    tiny_qwen3_config(vocab_size=policy.vocab_size + 8).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"vocabulary of .* the policy"):
        _reference_config(str(tmp_path), policy)
    tiny_qwen3_config(num_hidden_layers=3).save_pretrained(tmp_path)
    assert _reference_config(str(tmp_path), policy).num_hidden_layers == 3
