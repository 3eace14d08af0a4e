"""PPO's critic on the Megatron backend, on 2 gloo processes (tensor parallel 2, float32) through the
training CPU shim: a value model on the policy's ranks whose new head is the same on both
tensor-parallel ranks and stays so while it trains; a critic-only rollout leaves the policy
bit-identical; its value loss falls over rollouts of one batch; sleep / wake-up keeps its values; a
saved critic reloads exactly (the same values, and the same next rollout); its HF export is a
one-label token-classification model that gives those values at the positions predicting the
response; a critic on ranks of its own (role "critic") started from that export gives them too,
and trains on returns it is handed. Agreement with the FSDP critic: tests/e2e/test_megatron_matches_fsdp.py."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

from tests.support.distributed import free_port

from .actor_lifecycle import make_args, make_batch
from .cpu_shim import install_megatron_training_cpu_shim, run_distributed

WORLD = 2
SETTINGS = {"params_dtype": "float32", "make_vocab_size_divisible_by": 8,
            "tensor_model_parallel_size": 2}  # fmt: skip


def _ppo_actor(rank: int, checkpoint: Path, save_dir: Path):
    import miles.backends.megatron_utils.actor as actor_module
    from miles.backends.training_utils.algorithms.critic_config import CriticConfig
    from miles.backends.training_utils.algorithms.loss_config import LossConfig

    actor_module.require_gpu = lambda: None  # the backend refuses CPU machines; the shim is why
    actor = actor_module.MegatronTrainRayActor(rank, WORLD, "127.0.0.1", free_port())
    args = make_args(checkpoint, save_dir, **SETTINGS)
    critic = CriticConfig(
        critic_save=str(save_dir / "critic"), critic_load=str(save_dir / "critic"),
        critic_lr=5e-3, num_critic_only_steps=1,
    )  # fmt: skip
    args = dataclasses.replace(
        args, spec=dataclasses.replace(args.spec, critic=critic),
        loss=LossConfig(advantage_estimator="ppo", lambd=0.95, value_clip=0.2),
    )  # fmt: skip
    args.init(actor)
    return actor


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _head(actor) -> torch.Tensor:
    return actor.critic_engine.model.module.output_layer.score.weight.detach().clone()


def _life(rank: int, checkpoint: Path, save_dir: Path, export_dir: Path) -> dict:
    install_megatron_training_cpu_shim()
    actor = _ppo_actor(rank, checkpoint, save_dir)
    batch = make_batch(seed=0)
    out = {"new_head": _head(actor)}
    policy, critic = _weights(actor.engine.model.module), _weights(actor.critic_engine.model.module)

    out["critic_only"] = actor.train(0, make_batch(seed=0))  # --num-critic-only-steps 1
    after = _weights(actor.critic_engine.model.module)
    out["policy_kept"] = all(
        torch.equal(p, policy[n]) for n, p in _weights(actor.engine.model.module).items()
    )
    out["critic_moved"] = any(not torch.equal(p, critic[n]) for n, p in after.items())
    out["trained_head"] = _head(actor)

    actor.save_model(0)
    out["saved"] = torch.cat(actor.trainer.critic.values(batch))
    out["both"] = actor.train(1, make_batch(seed=1))
    out["moved"] = torch.cat(actor.trainer.critic.values(batch))

    actor.sleep()  # the policy's and the critic's memory
    out["critic_slept_bytes"] = actor.critic_engine._offloader.nbytes
    actor.wake_up()
    out["woken"] = torch.cat(actor.trainer.critic.values(batch))

    out["resumed_from"] = actor._resume()
    out["reloaded"] = torch.cat(actor.trainer.critic.values(batch))
    actor.critic_engine.export_hf(export_dir)
    out["both_again"] = actor.train(1, make_batch(seed=1))  # from the reloaded models and Adams
    out["fixed_batch"] = [actor.train(r, make_batch(seed=0)) for r in (2, 3, 4)]  # one batch
    return out


@pytest.fixture(scope="module")
def life(tmp_path_factory) -> dict:
    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("megatron_critic")
    checkpoint = build_tiny_checkpoint(tmp / "hf", seed=0)
    export = tmp / "export"
    ranks = run_distributed(_life, WORLD, checkpoint, tmp / "save", export, timeout_s=420)
    return {"ranks": ranks, "export": export}


def test_the_new_value_head_is_the_same_on_both_tensor_parallel_ranks_and_stays_so(life):
    rank0, rank1 = life["ranks"]
    assert torch.equal(rank0["new_head"], rank1["new_head"])
    assert rank0["new_head"].std() > 0  # drawn, not zeros
    # Both ranks computed the same gradient for the replicated head, so took the same step.
    assert torch.equal(rank0["trained_head"], rank1["trained_head"])
    assert not torch.equal(rank0["trained_head"], rank0["new_head"])


def test_a_critic_only_rollout_trains_the_critic_and_leaves_the_policy_bit_identical(life):
    for rank in life["ranks"]:
        assert rank["policy_kept"] and rank["critic_moved"]
        for step in rank["critic_only"]:
            assert "train/loss" not in step and 0 < step["critic/grad_norm"] < float("inf")
            assert step["critic/lr"] == pytest.approx(5e-3)
        assert "train/loss" in rank["both"][0] and "critic/value_loss" in rank["both"][0]
    assert life["ranks"][0]["critic_only"] == life["ranks"][1]["critic_only"]


def test_the_value_loss_falls_over_rollouts_of_one_batch(life):
    # Each rollout's first step: the loss of the values the previous rollout on it left.
    losses = [rollout[0]["critic/value_loss"] for rollout in life["ranks"][0]["fixed_batch"]]
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert losses[-1] < 0.5 * losses[0], losses


def test_sleep_frees_the_critic_and_wake_up_brings_back_its_values(life):
    for rank in life["ranks"]:
        assert rank["critic_slept_bytes"] > 0
        assert torch.equal(rank["woken"], rank["moved"])


def test_a_saved_critic_reloads_exactly_and_resumes_like_no_stop(life):
    for rank in life["ranks"]:
        assert rank["resumed_from"] == 1
        assert not torch.equal(rank["moved"], rank["saved"]), "the critic did not train after"
        assert torch.equal(rank["reloaded"], rank["saved"])
        # Weights, Adam moments and steps, schedule: the rollout after the checkpoint again.
        assert rank["both_again"] == rank["both"]


def test_the_exported_critic_gives_the_values_at_the_positions_predicting_the_response(life):
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(life["export"], dtype=torch.float64)
    assert model.config.num_labels == 1
    batch, want = make_batch(seed=0), []
    for tokens, length in zip(batch["tokens"], batch["response_lengths"], strict=True):
        with torch.no_grad():
            scores = model.eval()(input_ids=torch.tensor([tokens])).logits[0, :, 0]  # (L,)
        end = len(tokens) - 1
        want.append(scores[end - length : end])
    got = life["ranks"][0]["reloaded"].double()
    torch.testing.assert_close(got, torch.cat(want), atol=1e-5, rtol=0)


def _own_ranks_life(rank: int, checkpoint: Path, export_dir: Path, save_dir: Path) -> dict:
    """Role "critic" (--critic-num-nodes): no policy on these ranks, so the critic's engine forms
    the Megatron groups itself; it starts from the exported critic."""
    install_megatron_training_cpu_shim()
    import miles.backends.megatron_utils.actor as actor_module
    from miles.backends.training_utils.algorithms.critic_config import CriticConfig
    from miles.backends.training_utils.algorithms.loss_config import LossConfig

    actor_module.require_gpu = lambda: None  # the backend refuses CPU machines; the shim is why
    actor = actor_module.MegatronTrainRayActor(rank, WORLD, "127.0.0.1", free_port())
    args = make_args(checkpoint, save_dir, **SETTINGS)
    critic = CriticConfig(
        critic_hf_checkpoint=str(export_dir), critic_save=str(save_dir / "critic"),
        critic_lr=5e-3, critic_num_nodes=1,
    )  # fmt: skip
    spec = dataclasses.replace(args.spec, critic=critic, load=None)
    loss = LossConfig(advantage_estimator="ppo", lambd=0.95, value_clip=0.2)
    start = actor.init(spec, loss, args.megatron, role="critic")
    batch = make_batch(seed=0)
    values = actor.critic_values(dict(batch))
    returns = [v.detach() + 1.0 for v in values]  # targets one above: the loss is known
    steps = actor.train_critic(0, dict(batch), values, returns)
    actor.save_model(0)
    actor.commit_checkpoint(0)
    return {
        "start": start, "engine": actor.engine, "values": torch.cat(values), "steps": steps,
        "after": torch.cat(actor.critic_values(dict(batch))),
    }  # fmt: skip


@pytest.fixture(scope="module")
def own_ranks(life, tmp_path_factory) -> list[dict]:
    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("megatron_critic_own_ranks")
    checkpoint = build_tiny_checkpoint(tmp / "hf", seed=0)
    return run_distributed(
        _own_ranks_life, WORLD, checkpoint, life["export"], tmp / "save", timeout_s=300
    )


def test_a_critic_on_ranks_of_its_own_starts_from_a_checkpoint_and_trains_on_given_returns(
    life, own_ranks
):
    for rank in own_ranks:
        assert rank["start"] == 0 and rank["engine"] is None  # no policy on these ranks
        # The exported critic's values, now in an engine that formed its own groups.
        torch.testing.assert_close(rank["values"], life["ranks"][0]["reloaded"], atol=1e-5, rtol=0)
        first = rank["steps"][0]
        # Values before the step are the clip's anchor: the loss of returns one above them.
        assert first["critic/value_loss"] == pytest.approx(0.5, rel=1e-5)
        assert first["critic/step"] == 1.0 and len(rank["steps"]) == 2
        assert (rank["after"] - rank["values"]).mean() > 0  # moved toward the returns
    assert own_ranks[0]["steps"] == own_ranks[1]["steps"]
