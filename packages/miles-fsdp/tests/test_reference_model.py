"""The FSDP reference model on 2 gloo ranks: --ref-load builds it from another checkpoint than the
policy's (its log-probs are that checkpoint's), and --ref-update-interval K sets it to an exact
copy of the policy after every K-th rollout, and only then."""

from __future__ import annotations

from pathlib import Path

import torch

from .distributed import run_distributed
from .test_actor import (
    SAMPLES,
    build_checkpoint,
    local_shard,
    make_actor,
    make_args,
    make_batch,
    sample_log_probs,
)

TEMPERATURE = 0.8  # make_args' rollout temperature


def _reference_life(rank: int, policy: Path, reference: Path) -> dict:
    args = make_args(policy, loss={"use_kl_loss": True, "kl_loss_coef": 0.1})
    args = args.with_paths(ref_load=str(reference), ref_update_interval=2)
    actor, _ = make_actor(rank, 2, args)
    batch = make_batch(SAMPLES)

    def log_probs(reference: bool) -> list[list[float]]:
        shard = local_shard(batch, rank, 2)
        return [lp.tolist() for lp in actor.trainer.log_probs(shard, reference=reference)]

    loaded = log_probs(reference=True)
    actor.train(0, local_shard(batch, rank, 2))  # rollout 0 of an interval of 2: no copy
    after_first = {"reference": log_probs(True), "policy": log_probs(False)}
    actor.train(1, local_shard(batch, rank, 2))  # the 2nd rollout: the policy is copied
    after_second = {"reference": log_probs(True), "policy": log_probs(False)}
    return {"loaded": loaded, "first": after_first, "second": after_second}


def test_ref_load_and_ref_update_interval(tmp_path):
    from transformers import AutoModelForCausalLM

    policy = build_checkpoint(tmp_path / "policy", seed=0)
    reference = build_checkpoint(tmp_path / "reference", seed=1)
    results = run_distributed(_reference_life, 2, policy, reference, timeout_s=240)
    models = {
        name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
        for name, path in (("policy", policy), ("reference", reference))
    }
    batch = make_batch(SAMPLES)
    for rank, result in enumerate(results):
        shard = local_shard(batch, rank, 2)
        with torch.no_grad():
            want = {
                name: [
                    sample_log_probs(model, tokens, length, TEMPERATURE)[0]
                    for tokens, length in zip(
                        shard["tokens"], shard["response_lengths"], strict=True
                    )
                ]
                for name, model in models.items()
            }
        for got, ref, pol in zip(result["loaded"], want["reference"], want["policy"], strict=True):
            got = torch.tensor(got, dtype=torch.float64)
            # --ref-load's checkpoint, not the policy's.
            torch.testing.assert_close(got, ref.double(), atol=1e-5, rtol=0)
            assert not torch.allclose(got, pol.double(), atol=1e-3)
        first, second = result["first"], result["second"]
        assert first["reference"] == result["loaded"], f"rank {rank}: copied before rollout 2"
        assert first["policy"] != first["reference"]
        assert second["reference"] == second["policy"], f"rank {rank}: not an exact copy"
        assert second["policy"] != first["policy"], "the second rollout trained"
