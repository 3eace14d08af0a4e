"""The gradient of a global batch does not depend on micro-batch size or data-parallel size.

(mbs=1, dp=1) in one process against (mbs=4, dp=2) on two real gloo ranks that average their
gradients as FSDP does, for every loss reduction, with clipping, KL loss and entropy active.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from miles.backends.training_utils.algorithms.loss import LossNormalizer, policy_loss
from miles.backends.training_utils.algorithms.loss_config import LossConfig
from miles.backends.training_utils.step.logprobs import get_log_probs_and_entropy
from tests.support.distributed import run_distributed

VOCAB, HIDDEN, NUM_SAMPLES = 13, 8, 8
MODES = {
    "sample_mean": {},
    "token_mean": {"loss_reduction": "token_mean"},
    "constant": {"loss_reduction": "constant", "loss_constant_normalizer": 6},
}


def _global_batch():
    gen = torch.Generator().manual_seed(7)
    samples = []
    for i in range(NUM_SAMPLES):
        prompt_len, response_len = 2 + i % 3, 1 + (5 * i) % 6
        tokens = torch.randint(0, VOCAB, (prompt_len + response_len,), generator=gen)
        mask = (torch.rand(response_len, generator=gen) > 0.25).double()
        samples.append(
            {
                "tokens": tokens,
                "prompt_len": prompt_len,
                "loss_mask": mask,
                # Old-policy log-probs off the current policy, so some ratios clip.
                "old_shift": torch.randn(response_len, generator=gen, dtype=torch.float64) * 0.3,
                "ref_shift": torch.randn(response_len, generator=gen, dtype=torch.float64) * 0.1,
                "advantage": float(torch.randn((), generator=gen)),
            }
        )
    return samples


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, VOCAB)
    ).double()


def _micro_batch_loss(model, samples, config, normalizer):
    log_probs, entropies, fields = (
        [],
        [],
        {k: [] for k in ("loss_mask", "old_shift", "ref_shift", "advantages")},
    )
    for s in samples:
        logits = model(s["tokens"][:-1])[s["prompt_len"] - 1 :]  # (R, V): predicts the response
        lp, ent = get_log_probs_and_entropy(logits, s["tokens"][s["prompt_len"] :], chunk_size=3)
        log_probs.append(lp.double())
        entropies.append(ent.double())
        for key in ("loss_mask", "old_shift", "ref_shift"):
            fields[key].append(s[key])
        fields["advantages"].append(torch.full_like(s["loss_mask"], s["advantage"]))
    log_probs_t = torch.cat(log_probs)
    batch = {
        "log_probs": log_probs_t,
        "entropy": torch.cat(entropies),
        "old_log_probs": log_probs_t.detach() + torch.cat(fields["old_shift"]),
        "ref_log_probs": log_probs_t.detach() + torch.cat(fields["ref_shift"]),
        "advantages": torch.cat(fields["advantages"]),
        "loss_mask": torch.cat(fields["loss_mask"]),
        "response_lengths": [len(s["loss_mask"]) for s in samples],
    }
    loss, _ = policy_loss(batch, config, normalizer)
    return loss


def _gradients(samples, indices, mbs, config, dp_size):
    model = _model()
    all_samples = _global_batch()
    normalizer = LossNormalizer(
        num_samples=len(all_samples),
        num_tokens=int(sum(s["loss_mask"].sum() for s in all_samples)),
        dp_size=dp_size,
    )
    for start in range(0, len(indices), mbs):
        micro = [samples[i] for i in indices[start : start + mbs]]
        _micro_batch_loss(model, micro, config, normalizer).backward()
    grads = [p.grad for p in model.parameters()]
    if dp_size > 1:
        for g in grads:
            dist.all_reduce(g)
            g /= dp_size  # average, as FSDP's reduce-scatter does (gloo has no AVG op)
    return [g.clone() for g in grads]


def _config(mode):
    return LossConfig(
        eps_clip=0.2,
        eps_clip_high=0.28,
        eps_clip_c=3.0,
        entropy_coef=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.05,
        kl_loss_type="low_var_kl",
        **MODES[mode],
    )


def _rank_gradients(rank: int, mode: str) -> list[list[float]]:
    samples = _global_batch()
    # Uneven token counts per rank on purpose: rank 0 gets the short samples.
    order = sorted(range(NUM_SAMPLES), key=lambda i: len(samples[i]["loss_mask"]))
    shard = order[:4] if rank == 0 else order[4:]
    grads = _gradients(samples, shard, mbs=4, config=_config(mode), dp_size=2)
    return [g.flatten().tolist() for g in grads]


def test_gradient_is_independent_of_micro_batch_and_dp_size_for_every_reduction():
    samples = _global_batch()
    for mode in MODES:
        reference = _gradients(
            samples, list(range(NUM_SAMPLES)), mbs=1, config=_config(mode), dp_size=1
        )
        per_rank = run_distributed(_rank_gradients, 2, mode)
        for rank_grads in per_rank:
            for got, want in zip(rank_grads, reference, strict=True):
                torch.testing.assert_close(
                    torch.tensor(got, dtype=torch.float64), want.flatten(), rtol=1e-9, atol=1e-12
                )
        assert any(w.abs().sum() > 0 for w in reference), f"{mode}: reference gradient is all zero"
