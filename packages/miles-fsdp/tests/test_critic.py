"""PPO's critic on the FSDP backend, on 2 gloo ranks: a value model on the policy's ranks whose
values are a token-classification forward's at the positions that predict response tokens; the
first --num-critic-only-steps rollouts leave the policy bit-identical; resume is exact for both
models; the critic exports as a one-label token-classification model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from .distributed import run_distributed
from .test_actor import SAMPLES, build_checkpoint, local_shard, make_actor, make_args, make_batch

PPO = {"advantage_estimator": "ppo", "lambd": 0.95, "value_clip": 0.2}


def _ppo_args(checkpoint: Path, save: Path, load: Path | None = None):
    from miles.backends.training_utils.algorithms.critic_config import CriticConfig

    args = make_args(checkpoint, loss=PPO)
    critic = CriticConfig(
        critic_save=str(save / "critic"), critic_load=str((load or save) / "critic"),
        critic_lr=5e-3, num_critic_only_steps=1,
    )  # fmt: skip
    spec = dataclasses.replace(
        args.spec, critic=critic, save=str(save), load=str(load) if load else None
    )
    return dataclasses.replace(args, spec=spec)


def _full(model) -> dict[str, torch.Tensor]:
    """Every parameter whole (the root's stay gathered after a forward without backward)."""
    return {
        n: p.detach().full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
        for n, p in model.named_parameters()
    }


def _critic_life(rank: int, checkpoint: Path, save: Path) -> dict:
    actor, _ = make_actor(rank, 2, _ppo_args(checkpoint, save))
    shard = local_shard(make_batch(SAMPLES), rank, 2)
    policy_start = _full(actor.engine.model)
    critic_start = _full(actor.critic_engine.model)
    critic_only = actor.train(0, shard)  # --num-critic-only-steps 1
    policy_after_critic_only = _full(actor.engine.model)
    critic_after = _full(actor.critic_engine.model)
    actor.save_model(0)
    values = [v.tolist() for v in actor.trainer.critic.values(dict(shard))]
    both = actor.train(1, shard)

    resumed, start = make_actor(rank, 2, _ppo_args(checkpoint, save, load=save))
    resumed_steps = resumed.train(1, shard)
    return {
        "policy_kept": all(
            torch.equal(policy_start[n], p) for n, p in policy_after_critic_only.items()
        ),
        "critic_moved": any(not torch.equal(critic_start[n], p) for n, p in critic_after.items()),
        "critic_only": critic_only,
        "both": both,
        "values": values,
        "resumed_start": start,
        "resumed": resumed_steps,
    }


@pytest.fixture(scope="module")
def critic_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("critic")
    checkpoint = build_checkpoint(root / "ckpt")
    results = run_distributed(_critic_life, 2, checkpoint, root / "save", timeout_s=300)
    return checkpoint, root / "save", results


def test_critic_only_rollouts_leave_the_policy_bit_identical(critic_run):
    _, _, results = critic_run
    for rank, result in enumerate(results):
        assert result["policy_kept"], f"rank {rank}: the policy moved in a critic-only rollout"
        assert result["critic_moved"], f"rank {rank}: the critic did not train"
        for step in result["critic_only"]:
            assert "train/loss" not in step and "critic/value_loss" in step
        for step in result["both"]:
            assert {"train/loss", "critic/value_loss", "critic/explained_variance",
                    "critic/values_mean", "critic/returns_mean", "critic/returns_variance",
                    "critic/grad_norm", "critic/lr", "critic/value_clipfrac"} <= step.keys()  # fmt: skip
        assert result["both"][0]["critic/lr"] == pytest.approx(5e-3)


def test_resume_is_exact_for_policy_and_critic(critic_run):
    _, _, results = critic_run
    for result in results:
        assert result["resumed_start"] == 1
        assert result["resumed"] == result["both"], "the resumed rollout differs"


def test_values_are_the_exported_critics_at_the_positions_predicting_the_response(
    critic_run, tmp_path
):
    from transformers import AutoModelForTokenClassification

    from miles.backends.fsdp_utils.checkpoint import export_checkpoint_to_hf

    _, save, results = critic_run
    export_checkpoint_to_hf(save / "critic", tmp_path / "critic")
    model = AutoModelForTokenClassification.from_pretrained(
        tmp_path / "critic", dtype=torch.float64
    ).eval()
    assert model.config.num_labels == 1
    batch = make_batch(SAMPLES)
    for rank, result in enumerate(results):
        shard = local_shard(batch, rank, 2)
        for tokens, length, got in zip(
            shard["tokens"], shard["response_lengths"], result["values"], strict=True
        ):
            with torch.no_grad():
                scores = model(input_ids=torch.tensor([tokens])).logits[0, :, 0]  # (L,)
            end = len(tokens) - 1
            want = scores[end - length : end]  # the positions whose logits predict the response
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want,
                                       atol=1e-5, rtol=0)  # fmt: skip
