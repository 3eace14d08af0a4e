"""--share-prompt-forward: a prompt forwarded once for the samples that share it gives the logits
and gradients of one forward per document, in float64 and through FSDP2 on 2 gloo ranks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .distributed import run_distributed
from .test_actor import (
    SAMPLES,
    build_checkpoint,
    capture_full_grads,
    local_shard,
    make_actor,
    make_args,
    reference_training,
)


@pytest.fixture(scope="module")
def float64_models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    checkpoint = build_checkpoint(tmp_path_factory.mktemp("ckpt"))
    return {
        attn: AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float64, attn_implementation=attn
        )
        for attn in ("sdpa", "eager")
    }


def grouped_documents(
    rng: random.Random, groups: int, max_samples: int
) -> tuple[list[list[int]], list[int]]:
    """Groups of 1..max_samples documents sharing a prompt of 1..6 tokens; responses of 0..6
    tokens (0: a document with nothing to train on), groups interleaved as a shuffle leaves them."""
    documents = []
    for _ in range(groups):
        prompt = [rng.randrange(1, 256) for _ in range(rng.randint(1, 6))]
        for _ in range(rng.randint(1, max_samples)):
            response = [rng.randrange(1, 256) for _ in range(rng.randint(0, 6))]
            documents.append((prompt + response, len(response)))
    rng.shuffle(documents)
    return [tokens for tokens, _ in documents], [length for _, length in documents]


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**16), groups=st.integers(1, 4), attn=st.sampled_from(["sdpa", "eager"])
)
def test_shared_prompt_logits_and_gradients_equal_per_document_ones(
    float64_models, seed, groups, attn
):
    from miles.backends.fsdp_utils.modeling import packed_logits, response_positions
    from miles.backends.fsdp_utils.prompt_sharing import plan_shared_prompts, shared_prompt_logits
    from miles.backends.training_utils.batching.packing import pack_sequences

    model = float64_models[attn]
    tokens, response_lengths = grouped_documents(random.Random(seed), groups, max_samples=4)
    packed = pack_sequences(tokens, response_lengths, [[1] * r for r in response_lengths], 8)
    plan = plan_shared_prompts(packed)
    trained = [(t[: len(t) - r], r) for t, r in zip(tokens, response_lengths, strict=True) if r]
    # Forwarded once each: the prompts but their last token (which opens each document's row).
    prefixes = {tuple(prompt[:-1]) for prompt, _ in trained}
    shared_tokens = len(prefixes) * max(map(len, prefixes), default=0) + len(trained) * max(
        (r for _, r in trained), default=0
    )
    per_document = len(tokens) * max(map(len, tokens))
    worth_it = len(prefixes) < len(trained) and shared_tokens < per_document and any(prefixes)
    assert (plan is not None) == worth_it
    if plan is None:
        return
    assert plan.num_tokens == shared_tokens
    assert plan.prefixes.shape[0] == len(prefixes)
    cpu = torch.device("cpu")
    positions = response_positions(packed)
    weights = torch.randn(len(positions), model.config.vocab_size, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(seed))  # fmt: skip
    results = []
    for shared in (False, True):
        model.zero_grad()
        if shared:
            logits = shared_prompt_logits(model, plan, cpu)
        else:
            logits = packed_logits(
                model, packed, attn_implementation=attn, device=cpu, positions=positions
            )
        (logits * weights).sum().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (want, want_grads), (got, got_grads) = results
    assert got.shape == (sum(response_lengths), model.config.vocab_size)
    # transformers' RMSNorm (and eager softmax) compute in float32, also in a float64 model: the
    # shared prompt's other summation order shows at about 1e-7 of the logits' and gradients'
    # scale (hypothesis found seeds where the logits differ by 1.2e-7). A wrong layout is off by
    # O(1).
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    for grad, want_grad in zip(got_grads, want_grads, strict=True):
        assert (grad - want_grad).abs().max() <= 1e-5 * want_grad.abs().max()


def grouped_batch(
    samples: int = SAMPLES, group_size: int = 8, seed: int = 0, *, unique_odd_rows: bool = False
) -> dict[str, list]:
    """A rollout of GRPO groups: `group_size` consecutive samples answer one prompt;
    `unique_odd_rows`: every odd row has a prompt of its own (rank 1 of 2 then shares none)."""
    rng = random.Random(seed)
    batch: dict[str, list] = {k: [] for k in ("tokens", "response_lengths", "total_lengths")}
    batch.update(loss_mask=[], rewards=[])
    for index in range(samples):
        if index % group_size == 0 or (unique_odd_rows and index % 2):
            prompt = [rng.randrange(256) for _ in range(rng.randint(3, 7))]
        response = [rng.randrange(256) for _ in range(rng.randint(1, 8))]
        mask = [1] * len(response)
        mask[rng.randrange(len(response))] = rng.choice([0, 1])
        batch["tokens"].append(prompt + response)
        batch["response_lengths"].append(len(response))
        batch["total_lengths"].append(len(prompt) + len(response))
        batch["loss_mask"].append(mask)
        batch["rewards"].append(rng.uniform(-1, 1))
    return batch


def _train_with_shared_prompts(rank: int, checkpoint: Path) -> list[dict]:
    """Both --fsdp-gather modes (FSDP2 re-gathers per forward, or keeps the step's gather): two
    forwards of a micro-batch before its backward must reduce the same gradients as one."""
    from miles.backends.fsdp_utils import engine as engine_module

    calls = []
    shared_logits = engine_module.shared_prompt_logits

    def counting(*args, **kwargs):
        calls.append(1)
        return shared_logits(*args, **kwargs)

    engine_module.shared_prompt_logits = counting
    results = []
    for fsdp, batch in [
        ({"fsdp_gather": "micro_batch"}, grouped_batch()),
        ({"fsdp_gather": "step"}, grouped_batch()),
        # Rank 0's micro-batches could share, rank 1's cannot: neither may (a deadlock else).
        ({"fsdp_gather": "micro_batch"}, grouped_batch(unique_odd_rows=True)),
        # transformers turns the KV cache off under activation checkpointing: the policy forwards
        # per document, the reference model (never checkpointed) still shares.
        ({"gradient_checkpointing": True}, grouped_batch()),
    ]:
        args = make_args(checkpoint, use_dynamic_batch_size=True, max_tokens_per_gpu=128,
                         loss={"use_kl_loss": True, "kl_loss_coef": 0.5}, **fsdp)  # fmt: skip
        actor, _ = make_actor(rank, 2, args, with_ref=True)
        captured = capture_full_grads(actor)
        calls.clear()
        metrics = actor.train(0, local_shard(batch, rank, 2))
        if rank != 0:
            results.append({"shared_forwards": len(calls)})
            continue
        ref_grads, ref_norms, _ = reference_training(args, batch)
        results.append({
            "shared_forwards": len(calls),
            "norms": [m["train/grad_norm"] for m in metrics],
            "ref_norms": ref_norms,
            "grad_diff": [
                max(float((c[k] - r[k]).abs().max() / r[k].abs().max()) for k in r)
                for c, r in zip(captured, ref_grads, strict=True)
            ],
        })  # fmt: skip
    return results


def test_fsdp_steps_with_shared_prompts_equal_a_per_document_reference(tmp_path):
    checkpoint = build_checkpoint(tmp_path / "ckpt")
    rank0, rank1 = run_distributed(_train_with_shared_prompts, 2, checkpoint, timeout_s=240)
    # Per rollout: the reference model's log-probs, the old policy's (two optimizer steps), two
    # steps; each one micro-batch per rank of 4 samples of one prompt. Where rank 1 holds no
    # shared prompt, no rank shares; with checkpointing only the reference model does.
    assert [case["shared_forwards"] for case in rank0] == [4, 4, 0, 1]
    assert [case["shared_forwards"] for case in rank1] == [4, 4, 0, 1]
    for case in rank0:
        torch.testing.assert_close(case["norms"], case["ref_norms"], rtol=1e-4, atol=0)
        assert max(case["grad_diff"]) < 1e-4, case


UNSUPPORTED = [
    ({"attn_implementation": "flash_attention_2"}, "--attn-implementation flash_attention_2"),
    ({"packs_one_row": True}, "Gated DeltaNet"),
    ({"moe": True}, "MoE"),
    ({"gradient_checkpointing": True}, "--gradient-checkpointing"),
]


@pytest.mark.parametrize(("setting", "reason"), UNSUPPORTED)
def test_what_cannot_share_a_prompt_says_why(float64_models, setting, reason):
    from miles.backends.fsdp_utils.prompt_sharing import prompt_sharing_unsupported

    settings_ = {"attn_implementation": "sdpa", "gradient_checkpointing": False, "moe": False,
                 "packs_one_row": False}  # fmt: skip
    model = float64_models["sdpa"]
    assert prompt_sharing_unsupported(model, **settings_) is None
    assert reason in prompt_sharing_unsupported(model, **{**settings_, **setting})
