"""Qwen3-MoE on the FSDP backend, 2 gloo ranks: a tiny model (4 experts, 2 per token, 2 layers)
trains, resumes exactly from its checkpoint and exports a Hugging Face checkpoint that
`from_pretrained` loads as the trained weights (its weight updates are tested with the dense
model's, in test_update_weights.py); routing replay; the load-balancing loss and metrics."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from .distributed import run_distributed
from .test_actor import SAMPLES, full_params, local_shard, make_actor, make_args, make_batch
from .test_update_weights import engine_process


def build_moe_checkpoint(path: Path, seed: int = 0) -> Path:
    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

    return build_tiny_checkpoint(path, seed=seed, architecture="qwen3_moe")


def _moe_life_cycle(rank: int, checkpoint: Path, save_dir: Path, export_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    args = make_args(checkpoint).with_paths(save=str(save_dir))
    actor, start = make_actor(rank, 2, args)
    before = full_params(actor.engine.model)
    batch = make_batch(SAMPLES)
    steps = actor.train(0, local_shard(batch, rank, 2))
    actor.save_model(0)
    saved = full_params(actor.engine.model)
    experts_moved = all(
        not torch.equal(before[name], saved[name]) for name in saved if ".experts." in name
    )
    router_moved = all(
        not torch.equal(before[name], saved[name]) for name in saved if ".mlp.gate." in name
    )
    next_steps = actor.train(1, local_shard(batch, rank, 2))
    resumed, resumed_start = make_actor(rank, 2, args.with_paths(load=str(save_dir)))
    restored = all(torch.equal(saved[n], p) for n, p in full_params(resumed.engine.model).items())
    resumed_steps = resumed.train(1, local_shard(batch, rank, 2))
    resumed.export_hf(export_dir)
    trained = full_params(resumed.engine.model)
    export_matches = None
    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
        exported = {n: p.detach() for n, p in model.named_parameters()}
        export_matches = exported.keys() == trained.keys() and all(
            torch.equal(trained[n], exported[n]) for n in exported
        )
    return {
        "start": start, "resumed_start": resumed_start, "steps": steps,
        "experts_moved": experts_moved, "router_moved": router_moved, "restored": restored,
        "next_losses": [s["train/loss"] for s in next_steps],
        "resumed_losses": [s["train/loss"] for s in resumed_steps],
        "export_matches": export_matches,
    }  # fmt: skip


def test_a_tiny_qwen3_moe_trains_resumes_exactly_and_exports(tmp_path):
    checkpoint = build_moe_checkpoint(tmp_path / "moe")
    results = run_distributed(
        _moe_life_cycle, 2, checkpoint, tmp_path / "save", tmp_path / "export", timeout_s=240
    )
    for rank, result in enumerate(results):
        assert result["start"] == 0 and result["resumed_start"] == 1
        assert result["experts_moved"], f"rank {rank}: an expert's weights did not train"
        assert result["router_moved"], f"rank {rank}: the router did not train"
        assert result["restored"], f"rank {rank}: resuming did not restore the saved weights"
        # Resumed from the checkpoint, rollout 1 trains exactly as it did without the stop.
        assert result["resumed_losses"] == result["next_losses"]
    assert results[0]["export_matches"], "the HF export differs from the trained weights"


# -- routing replay ---------------------------------------------------------------------------


def build_near_tie_checkpoint(path: Path, seed: int = 0, spread: float = 1e-6) -> Path:
    """A tiny Qwen3-MoE whose routers are near a tie: every expert's router row is one shared
    vector plus `spread` times noise, so which experts win turns on differences of the size of
    float rounding (what another batch layout or kernel changes)."""
    from transformers import AutoModelForCausalLM

    build_moe_checkpoint(path, seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # (experts, hidden)
                shared = torch.randn(parameter.shape[1], generator=generator)
                noise = torch.randn(parameter.shape, generator=generator)
                parameter.copy_(shared + spread * noise)
    model.save_pretrained(path)
    return path


def _logprob_gap(
    rank: int, checkpoint: Path, answers: list[dict], replay: str | None, fsdp: dict
) -> float:
    """Mean |trainer - engine| log-prob over the engines' sampled tokens, replaying its experts
    (`replay` "rollout") or letting the trainer's routers choose (None); `fsdp`: FSDPArgs."""
    import dataclasses

    args = make_args(checkpoint, **fsdp).with_paths(rollout_temperature=1.0)
    args = dataclasses.replace(args, spec=dataclasses.replace(args.spec, routing_replay=replay))
    actor, _ = make_actor(rank, 2, args)
    batch = {k: [] for k in ("tokens", "response_lengths", "total_lengths", "loss_mask",
                             "routed_experts", "sample_indices")}  # fmt: skip
    for index, answer in enumerate(answers):
        tokens = answer["prompt"] + answer["output_ids"]
        batch["tokens"].append(tokens)
        batch["response_lengths"].append(len(answer["output_ids"]))
        batch["total_lengths"].append(len(tokens))
        batch["loss_mask"].append([1] * len(answer["output_ids"]))
        batch["routed_experts"].append(answer["meta_info"]["routed_experts"])
        batch["sample_indices"].append(index)
    trainer = actor.trainer.log_probs(batch)
    gaps = [
        (mine - torch.tensor([entry[0] for entry in a["meta_info"]["output_token_logprobs"]])).abs()
        for mine, a in zip(trainer, answers, strict=True)
    ]
    return float(torch.cat(gaps).mean())


def test_rollout_routing_replay_makes_trainer_and_engine_agree_on_a_near_tie_router(tmp_path):
    """R3's measurement (README, "Supported models"): with the engine's experts replayed, the
    trainer's log-probs of the engine's own samples match the engine's to float tolerance; with
    the trainer's routers choosing, near-tie flips make them measurably differ."""
    import httpx

    from .test_update_weights import wait_healthy

    checkpoint = build_near_tie_checkpoint(tmp_path / "near-tie")
    prompts = [[72, 101, 108, 108, 111], [84, 104, 101, 32, 99, 97, 116], [49, 43, 49, 61]]
    with engine_process(checkpoint, "--enable-return-routed-experts") as url:
        wait_healthy(url)
        body = {"input_ids": [p for p in prompts for _ in range(4)], "return_logprob": True,
                "return_routed_experts": True,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True}}  # fmt: skip
        answers = httpx.post(f"{url}/generate", json=body, timeout=120).json()
    for answer, prompt in zip(answers, [p for p in prompts for _ in range(4)], strict=True):
        answer["prompt"] = prompt
    one_per_micro_batch = {}
    # Dynamic micro-batches: several documents per forward, padded rows of unequal lengths.
    packed = {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 128}
    replayed = run_distributed(
        _logprob_gap, 2, checkpoint, answers, "rollout", one_per_micro_batch, timeout_s=240
    )[0]
    replayed_packed = run_distributed(
        _logprob_gap, 2, checkpoint, answers, "rollout", packed, timeout_s=240
    )[0]
    free = run_distributed(
        _logprob_gap, 2, checkpoint, answers, None, one_per_micro_batch, timeout_s=240
    )[0]
    print(f"mean |trainer - engine| log-prob: {free:.3g} without R3, {replayed:.3g} with R3 "
          f"({replayed_packed:.3g} with several documents per micro-batch)")  # fmt: skip
    assert replayed < 1e-5 and replayed_packed < 1e-5, (replayed, replayed_packed)
    assert free > 100 * max(replayed, 1e-7), (free, replayed)


def _routing_per_micro_batch(rank: int, checkpoint: Path, replay: str | None) -> dict:
    """The experts every router picked in each forward of one rollout's training (the
    old-policy pass, then the micro-batches of its two optimizer steps)."""
    import dataclasses

    from miles.backends.training_utils.step.routing_replay import moe_routers

    args = make_args(checkpoint, lr=0.05)
    args = dataclasses.replace(args, spec=dataclasses.replace(args.spec, routing_replay=replay))
    actor, _ = make_actor(rank, 2, args)
    picked: list[torch.Tensor] = []  # one (tokens, top_k) per router call
    for router in moe_routers(actor.engine.model):
        router.register_forward_hook(lambda module, inputs, out: picked.append(out[-1].clone()))
    batch = make_batch(SAMPLES)
    batch["sample_indices"] = list(range(SAMPLES))  # as samples_to_rollout_batch numbers them
    actor.train(0, local_shard(batch, rank, 2))
    layers = len(moe_routers(actor.engine.model))
    forwards = [torch.stack(picked[i : i + layers]) for i in range(0, len(picked), layers)]
    half = len(forwards) // 2  # old-policy pass, then the same micro-batches trained
    return {
        "forwards": len(forwards),
        "same": [torch.equal(forwards[i], forwards[half + i]) for i in range(half)],
    }


def test_routing_replay_r2_routes_every_optimizer_step_as_the_old_policy_did(tmp_path):
    checkpoint = build_near_tie_checkpoint(tmp_path / "near-tie", seed=1)
    replayed = run_distributed(_routing_per_micro_batch, 2, checkpoint, "old_policy", timeout_s=240)
    free = run_distributed(_routing_per_micro_batch, 2, checkpoint, None, timeout_s=240)
    for rank in range(2):
        assert replayed[rank]["forwards"] == 16  # 8 micro-batches: old-policy pass + 2 steps
        assert all(replayed[rank]["same"]), replayed[rank]
    # Without replay the second step's forwards (after the first optimizer step) route some
    # tokens elsewhere: the near-tie routers flip.
    assert not all(free[0]["same"] + free[1]["same"]), free


# -- the load-balancing loss and the routing metrics ----------------------------------------------


def _one_step(rank: int, checkpoint: Path, coef: float) -> dict:
    args = make_args(checkpoint, moe_aux_loss_coef=coef, clip_grad=1e9)  # no global scaling
    actor, _ = make_actor(rank, 2, args)
    before = full_params(actor.engine.model)
    batch = make_batch(8)  # one optimizer step
    steps = actor.train(0, local_shard(batch, rank, 2))
    after = full_params(actor.engine.model)
    return {"metrics": steps[-1], "delta": {n: after[n] - before[n] for n in after}}


def test_the_load_balancing_loss_trains_the_routers_and_the_metrics_describe_them(tmp_path):
    checkpoint = build_moe_checkpoint(tmp_path / "moe")
    off = run_distributed(_one_step, 2, checkpoint, 0.0, timeout_s=240)[0]
    on = run_distributed(_one_step, 2, checkpoint, 10.0, timeout_s=240)[0]
    metrics = on["metrics"]
    assert metrics["train/moe/aux_loss"] == pytest.approx(
        off["metrics"]["train/moe/aux_loss"], rel=1e-6
    )
    assert metrics["train/moe/aux_loss"] >= 1.0 - 1e-6  # E x sum f P is at least 1 (even: exactly)
    assert 0 < metrics["train/moe/router_entropy"] <= math.log(4) + 1e-6
    for layer in range(2):
        assert 1.0 <= metrics[f"train/moe/layer_{layer}/load_max_over_mean"] <= 4.0
    # The loss reaches the routers and what feeds them, not the last layer's experts (nothing
    # after them reads a router): those move as without it (Adam's first step is the
    # same gradient), the routers do not.
    for name, delta in on["delta"].items():
        if ".mlp.gate." in name:
            assert not torch.allclose(delta, off["delta"][name], atol=1e-7), name
        elif "layers.1.mlp.experts." in name:
            assert torch.allclose(delta, off["delta"][name], atol=1e-6), name
