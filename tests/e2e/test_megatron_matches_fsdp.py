"""The two training backends agree: on the same checkpoint, batch and loss, the Megatron actor
(tensor parallel 2, and context parallel 2, on 2 gloo processes through miles-megatron's test-only
CPU shim) and the FSDP actor take first optimizer steps with the same gradient norm and loss, and
report the same log-probs for the engine check. The issue asks for 3 %; float32 on CPU agrees far
closer. With context parallelism this checks the loss scaling: each rank holds half of every
sequence, and a gradient counted once per rank would be off by 2x."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from miles.backends.training_utils.testing import free_port, run_distributed
from miles.backends.training_utils.testing_batches import random_rollout_batch

_SHIM_PATH = Path(__file__).parents[2] / "packages/miles-megatron/tests/cpu_shim.py"
GLOBAL_BATCH = 4
TEMPERATURE = 0.8


def _megatron_cpu_shim():
    # Test-only code of another package's test suite, loaded by path: it is no installed module.
    spec = importlib.util.spec_from_file_location("megatron_cpu_shim", _SHIM_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_batch() -> dict[str, list]:
    # The "engine" log-probs are a constant -1: both trainers must be the same distance away.
    return random_rollout_batch(2 * GLOBAL_BATCH, seed=0, rollout_log_prob=-1.0)


def common_args(checkpoint: Path) -> dict:
    from miles.backends.training_utils.loss_config import LossConfig

    return {
        "hf_checkpoint": str(checkpoint), "loss": LossConfig(), "rollout_temperature": TEMPERATURE,
        "global_batch_size": GLOBAL_BATCH, "n_samples_per_prompt": 4, "num_rollout": 1,
        "rollout_batch_size": 2, "save": None, "load": None, "engine_urls": [], "colocate": True,
    }  # fmt: skip


MEGATRON_LAYOUTS = {"tp2": {"tensor_model_parallel_size": 2}, "cp2": {"context_parallel_size": 2}}


def _megatron(rank: int, checkpoint: Path, layout: dict) -> dict:
    import miles.backends.megatron_utils.actor as actor_module
    from miles.backends.megatron_utils.arguments import MegatronArgs

    _megatron_cpu_shim().install_megatron_training_cpu_shim()
    actor_module.require_gpu = lambda: None  # the backend refuses CPU machines; the shim is why
    megatron = MegatronArgs(params_dtype="float32", make_vocab_size_divisible_by=8, lr=1e-3,
                            seed=0, **layout)  # fmt: skip
    args = SimpleNamespace(megatron=megatron, **common_args(checkpoint))
    actor = actor_module.MegatronTrainRayActor(rank, 2, "127.0.0.1", free_port())
    actor.init(args, "actor", with_ref=False)
    gap = actor.logprob_gap(make_batch())
    return {"gap": gap, "steps": actor.train(0, make_batch())}


def _fsdp(rank: int, checkpoint: Path) -> dict:
    from miles.backends.fsdp_utils.actor import FSDPTrainRayActor
    from miles.backends.fsdp_utils.arguments import FSDPArgs

    fsdp = FSDPArgs(lr=1e-3, micro_batch_size=1, seed=0)
    args = SimpleNamespace(fsdp=fsdp, **common_args(checkpoint))
    actor = FSDPTrainRayActor(rank, 1, "127.0.0.1", free_port())
    actor.init(args, "actor", with_ref=False)
    gap = actor.logprob_gap(make_batch())
    return {"gap": gap, "steps": actor.train(0, make_batch())}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=0)


@pytest.fixture(scope="module")
def fsdp(checkpoint) -> dict:
    return run_distributed(_fsdp, 1, checkpoint, timeout_s=300)[0]


@pytest.fixture(scope="module", params=sorted(MEGATRON_LAYOUTS))
def both(request, checkpoint, fsdp) -> dict:
    layout = MEGATRON_LAYOUTS[request.param]
    return {"megatron": run_distributed(_megatron, 2, checkpoint, layout, timeout_s=300)[0],
            "fsdp": fsdp}  # fmt: skip


def test_first_steps_have_the_fsdp_backends_gradient_norm_and_loss(both):
    megatron, fsdp = both["megatron"]["steps"], both["fsdp"]["steps"]
    assert len(megatron) == len(fsdp) == 2
    # Step 1 starts from the same weights; step 2 also checks both optimizers made the same update.
    for ours, theirs in zip(megatron, fsdp, strict=True):
        assert ours["train/grad_norm"] == pytest.approx(theirs["train/grad_norm"], rel=1e-3)
        assert ours["train/pg_loss"] == pytest.approx(theirs["train/pg_loss"], rel=1e-3, abs=1e-6)
    assert megatron[0]["train/grad_norm"] == pytest.approx(fsdp[0]["train/grad_norm"], rel=0.03)


def test_both_backends_score_the_engine_check_alike(both):
    assert both["megatron"]["gap"] == pytest.approx(both["fsdp"]["gap"], rel=1e-5)
    assert torch.isfinite(torch.tensor(both["megatron"]["gap"]))
