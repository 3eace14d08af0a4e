"""The two training backends agree: on the same checkpoint, batch and loss, the Megatron actor
(tensor, pipeline and context parallel 2, on 2 gloo processes through miles-megatron's test-only
CPU shim) and the FSDP actor take first optimizer steps with the same gradient norm and loss, and
score the step-0 check alike (loss-mask weighted: the batch masks a token of every response).
The issue asks for 3 %; float32 on CPU agrees far closer. With context parallelism this checks the
loss scaling: each rank holds half of every sequence, and a gradient counted once per rank would be
off by 2x. A user's loss and advantage function, given by import path, train the same on both.
PPO's critics, started from one token-classification checkpoint, give the same values and take
critic-only steps with the same value loss and gradient norm: under tensor parallelism the value
head is on both ranks, and a gradient or norm counted once per rank would be off."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tests.support.distributed import free_port, run_distributed
from tests.support.rollout_batches import random_rollout_batch

_SHIM_PATH = Path(__file__).parents[2] / "packages/miles-megatron/tests/cpu_shim.py"
GLOBAL_BATCH = 4
TEMPERATURE = 0.8


def _megatron_cpu_shim():
    # Test-only code of another package's test suite, loaded by path: it is no installed module.
    spec = importlib.util.spec_from_file_location("megatron_cpu_shim", _SHIM_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Both backends' heavy imports, made once in the gloo workers' fork server (which keeps what the
# package suites before this one asked for).
PRELOAD = (
    *_megatron_cpu_shim().MEGATRON_PRELOAD,
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
)


def make_batch() -> dict[str, list]:
    # The "engine" log-probs are a constant -1: both trainers must be the same distance away.
    return random_rollout_batch(2 * GLOBAL_BATCH, seed=0, rollout_log_prob=-1.0, masked=True)


def run_spec(checkpoint: Path):
    from miles.train_backend import TrainRunSpec

    return TrainRunSpec(
        hf_checkpoint=str(checkpoint), rollout_temperature=TEMPERATURE,
        global_batch_size=GLOBAL_BATCH, num_rollout=1, num_steps_per_rollout=2, colocate=True,
    )  # fmt: skip


def custom_loss_config():
    """The user's functions by path; the module is importable from this test's directory."""
    from miles.backends.training_utils.algorithms.loss_config import LossConfig

    sys.path.insert(0, str(Path(__file__).parent))
    return LossConfig(
        loss_type="custom_loss", custom_loss_function_path="custom_algorithms:REINFORCE",
        advantage_estimator="custom",
        custom_advantage_function_path="custom_algorithms:reward_sign",
    )  # fmt: skip


def train_first_rollout(actor, checkpoint: Path, loss, backend) -> dict:
    actor.init(run_spec(checkpoint), loss, backend)
    gap = actor.logprob_gap(make_batch())
    return {"gap": gap, "steps": actor.train(0, make_batch())}


def build_critic_checkpoint(checkpoint: Path, out: Path) -> Path:
    """`checkpoint` as a one-label token-classification model with a seeded head and bias, as an
    exported critic would be: both backends must start from this `score`, not from a new one.
    Its config keeps transformers' default classifier dropout (0.1 in training): the FSDP
    critic must turn it off, as Megatron's has none."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(
        checkpoint, num_labels=1, dtype=torch.float32
    )
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():  # values of about +-1, as large as the rewards
        model.score.weight.copy_(0.1 * torch.randn(model.score.weight.shape, generator=generator))
        if model.score.bias is not None:
            model.score.bias.fill_(0.3)
    model.save_pretrained(out)
    return out


def train_critic_only_rollout(actor, checkpoint: Path, critic_checkpoint: Path, backend) -> dict:
    """PPO with a critic from `critic_checkpoint`: its values of the batch, then a rollout of
    critic-only steps (--num-critic-only-steps 1)."""
    from miles.backends.training_utils.algorithms.critic_config import CriticConfig
    from miles.backends.training_utils.algorithms.loss_config import LossConfig

    critic = CriticConfig(critic_hf_checkpoint=str(critic_checkpoint), critic_lr=5e-3,
                          num_critic_only_steps=1)  # fmt: skip
    spec = dataclasses.replace(run_spec(checkpoint), critic=critic)
    actor.init(spec, LossConfig(advantage_estimator="ppo", lambd=0.95, value_clip=0.2), backend)
    values = torch.cat(actor.trainer.critic.values(make_batch()))  # (sum R,)
    return {"values": values, "steps": actor.train(0, make_batch())}


MEGATRON_LAYOUTS = {"tp2": {"tensor_model_parallel_size": 2},
                    "pp2": {"pipeline_model_parallel_size": 2},
                    "cp2": {"context_parallel_size": 2}}  # fmt: skip


def _megatron(
    rank: int, checkpoint: Path, critic_checkpoint: Path, layout: dict, with_custom: bool
) -> dict:
    import miles.backends.megatron_utils.actor as actor_module
    from miles.backends.megatron_utils.arguments import MegatronArgs
    from miles.backends.megatron_utils.parallel import destroy_megatron_parallel
    from miles.backends.training_utils.algorithms.loss_config import LossConfig

    _megatron_cpu_shim().install_megatron_training_cpu_shim()
    actor_module.require_gpu = lambda: None  # the backend refuses CPU machines; the shim is why
    megatron = MegatronArgs(params_dtype="float32", make_vocab_size_divisible_by=8, lr=1e-3,
                            seed=0, **layout)  # fmt: skip

    def actor():
        return actor_module.MegatronTrainRayActor(rank, 2, "127.0.0.1", free_port())

    out = {"builtin": train_first_rollout(actor(), checkpoint, LossConfig(), megatron)}
    if with_custom:
        destroy_megatron_parallel()  # the next actor forms its groups anew
        out["custom"] = train_first_rollout(actor(), checkpoint, custom_loss_config(), megatron)
    destroy_megatron_parallel()
    out["critic"] = train_critic_only_rollout(actor(), checkpoint, critic_checkpoint, megatron)
    return out


def _fsdp(rank: int, checkpoint: Path, critic_checkpoint: Path) -> dict:
    from miles.backends.fsdp_utils.actor import FSDPTrainRayActor
    from miles.backends.fsdp_utils.arguments import FSDPArgs
    from miles.backends.training_utils.algorithms.loss_config import LossConfig

    fsdp = FSDPArgs(lr=1e-3, micro_batch_size=1, seed=0)

    def actor():
        return FSDPTrainRayActor(rank, 1, "127.0.0.1", free_port())

    return {
        "builtin": train_first_rollout(actor(), checkpoint, LossConfig(), fsdp),
        "custom": train_first_rollout(actor(), checkpoint, custom_loss_config(), fsdp),
        "critic": train_critic_only_rollout(actor(), checkpoint, critic_checkpoint, fsdp),
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=0)


@pytest.fixture(scope="module")
def critic_checkpoint(checkpoint, tmp_path_factory) -> Path:
    return build_critic_checkpoint(checkpoint, tmp_path_factory.mktemp("critic"))


@pytest.fixture(scope="module")
def fsdp(checkpoint, critic_checkpoint) -> dict:
    args = (checkpoint, critic_checkpoint)
    return run_distributed(_fsdp, 1, *args, timeout_s=300, preload=PRELOAD)[0]


@pytest.fixture(scope="module")
def megatron_runs(checkpoint, critic_checkpoint):
    """Rank 0's results per layout, each run once; the tp2 run also trains the custom functions."""
    runs: dict[str, dict] = {}

    def run(layout: str) -> dict:
        if layout not in runs:
            args = (checkpoint, critic_checkpoint, MEGATRON_LAYOUTS[layout], layout == "tp2")
            runs[layout] = run_distributed(_megatron, 2, *args, timeout_s=420, preload=PRELOAD)[0]
        return runs[layout]

    return run


@pytest.fixture(scope="module", params=sorted(MEGATRON_LAYOUTS))
def both(request, fsdp, megatron_runs) -> dict:
    return {"megatron": megatron_runs(request.param), "fsdp": fsdp}


def test_first_steps_have_the_fsdp_backends_gradient_norm_and_loss(both):
    megatron, fsdp = both["megatron"]["builtin"]["steps"], both["fsdp"]["builtin"]["steps"]
    assert len(megatron) == len(fsdp) == 2
    # Step 1 starts from the same weights; step 2 also checks both optimizers made the same update.
    for ours, theirs in zip(megatron, fsdp, strict=True):
        assert ours["train/grad_norm"] == pytest.approx(theirs["train/grad_norm"], rel=1e-3)
        assert ours["train/pg_loss"] == pytest.approx(theirs["train/pg_loss"], rel=1e-3, abs=1e-6)
    assert megatron[0]["train/grad_norm"] == pytest.approx(fsdp[0]["train/grad_norm"], rel=0.03)


def test_both_backends_score_the_engine_check_alike(both):
    megatron, fsdp = both["megatron"]["builtin"]["gap"], both["fsdp"]["builtin"]["gap"]
    assert megatron == pytest.approx(fsdp, rel=1e-5)
    assert torch.isfinite(torch.tensor(megatron))


def test_a_custom_loss_and_advantage_by_path_train_alike_on_both_backends(fsdp, megatron_runs):
    megatron, builtin = megatron_runs("tp2")["custom"]["steps"], fsdp["builtin"]["steps"]
    fsdp = fsdp["custom"]["steps"]
    for ours, theirs in zip(megatron, fsdp, strict=True):
        assert "train/reinforce_loss" in ours and "train/pg_loss" not in ours
        for key in ("train/loss", "train/reinforce_loss", "train/grad_norm"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-3, abs=1e-6), key
    # The user's loss is what trained: it differs from the built-in's on the same batch.
    assert fsdp[0]["train/loss"] != pytest.approx(builtin[0]["train/loss"], rel=1e-3)


def test_critics_from_one_checkpoint_give_the_fsdp_critics_values_loss_and_gradient_norm(both):
    megatron, fsdp = both["megatron"]["critic"], both["fsdp"]["critic"]
    torch.testing.assert_close(megatron["values"], fsdp["values"], rtol=1e-4, atol=1e-5)
    assert len(megatron["steps"]) == len(fsdp["steps"]) == 2
    # Step 1 starts from the checkpoint's critic; step 2 also checks both made the same update.
    for ours, theirs in zip(megatron["steps"], fsdp["steps"], strict=True):
        assert "train/loss" not in ours, "a critic-only rollout trained the policy"
        for key in ("critic/value_loss", "critic/grad_norm", "critic/values_mean"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-3, abs=1e-6), key
    assert fsdp["steps"][0]["critic/value_loss"] > 1e-3  # the loss has a gradient to compare
