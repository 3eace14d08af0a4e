"""Loss reductions against float64 references, micro-batch invariance, and loss composition."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.training_utils.algorithms.loss import (
    LossNormalizer,
    policy_loss,
    reduce_loss,
    sft_loss,
)
from miles.backends.training_utils.algorithms.loss_config import LossConfig

CONFIGS = {
    "sample_mean": LossConfig(),
    "token_mean": LossConfig(loss_reduction="token_mean"),
    "constant": LossConfig(loss_reduction="constant", loss_constant_normalizer=16),
}


def _reference(per_sample_losses, per_sample_masks, mode, constant=16):
    """Plain-Python float64 reduction over the whole batch, straight from the docstring formulas."""
    n = len(per_sample_losses)
    if mode == "sample_mean":
        total = 0.0
        for losses, mask in zip(per_sample_losses, per_sample_masks, strict=True):
            total += sum(x * m for x, m in zip(losses, mask, strict=True)) / max(1, sum(mask))
        return total / n
    token_sum = sum(
        x * m
        for xs, ms in zip(per_sample_losses, per_sample_masks, strict=True)
        for x, m in zip(xs, ms, strict=True)
    )
    if mode == "token_mean":
        return token_sum / max(1, sum(sum(m) for m in per_sample_masks))
    return token_sum / (n * constant)


batches = st.lists(
    st.integers(1, 12).flatmap(
        lambda length: st.tuples(
            st.lists(st.floats(-100, 100), min_size=length, max_size=length),
            st.lists(st.sampled_from([0, 1]), min_size=length, max_size=length),
        )
    ),
    min_size=1,
    max_size=10,
)


def _flat(samples):
    losses = torch.tensor([x for xs, _ in samples for x in xs], dtype=torch.float64)
    masks = torch.tensor([m for _, ms in samples for m in ms], dtype=torch.float64)
    return losses, masks, [len(ls) for ls, _ in samples]


@settings(max_examples=80, deadline=None)
@given(samples=batches, mode=st.sampled_from(list(CONFIGS)), cut=st.integers(0, 10))
def test_reduction_matches_reference_and_is_additive_over_micro_batches(samples, mode, cut):
    losses, masks, lengths = _flat(samples)
    normalizer = LossNormalizer(num_samples=len(samples), num_tokens=int(masks.sum()))
    whole = reduce_loss(losses, masks, lengths, config=CONFIGS[mode], normalizer=normalizer)
    expected = _reference([s[0] for s in samples], [s[1] for s in samples], mode)
    assert math.isfinite(whole.item())
    assert whole.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)

    cut = min(cut, len(samples))
    parts = [samples[:cut], samples[cut:]]
    summed = sum(
        reduce_loss(*_flat(part), config=CONFIGS[mode], normalizer=normalizer).item()
        for part in parts
        if part
    )
    assert summed == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_dp_size_scales_the_local_share_because_backends_average_gradients():
    losses, masks, lengths = torch.tensor([1.0, 3.0]), torch.tensor([1.0, 1.0]), [2]
    one = reduce_loss(
        losses,
        masks,
        lengths,
        config=CONFIGS["token_mean"],
        normalizer=LossNormalizer(num_samples=4, num_tokens=8),
    )
    two = reduce_loss(
        losses,
        masks,
        lengths,
        config=CONFIGS["token_mean"],
        normalizer=LossNormalizer(num_samples=4, num_tokens=8, dp_size=2),
    )
    assert one.item() == pytest.approx(0.5) and two.item() == pytest.approx(1.0)


def test_empty_mask_sample_contributes_zero_not_nan():
    losses, masks = torch.tensor([5.0, 5.0, 2.0]), torch.tensor([0.0, 0.0, 1.0])
    value = reduce_loss(
        losses,
        masks,
        [2, 1],
        config=CONFIGS["sample_mean"],
        normalizer=LossNormalizer(num_samples=2, num_tokens=1),
    )
    assert value.item() == pytest.approx(1.0)


def _policy_batch(seed=0, lengths=(3, 2)):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    logits = torch.randn(total, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 5, (total,), generator=gen)
    log_probs = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    return logits, {
        "log_probs": log_probs,
        "entropy": entropy,
        "old_log_probs": log_probs.detach(),
        "advantages": torch.tensor([1.0] * lengths[0] + [-2.0] * lengths[1], dtype=torch.float64),
        "loss_mask": torch.ones(total, dtype=torch.float64),
        "response_lengths": list(lengths),
        "ref_log_probs": log_probs.detach() - 0.1,
        "rollout_log_probs": log_probs.detach() + 0.3,
    }


def test_on_policy_loss_is_minus_mean_advantage_and_metrics_are_weighted_pairs():
    _, batch = _policy_batch()
    loss, metrics = policy_loss(batch, LossConfig(), LossNormalizer(num_samples=2, num_tokens=5))
    # ratio 1: per-token loss is -A; sample means -1 and 2, averaged over 2 samples.
    assert loss.item() == pytest.approx((-1.0 + 2.0) / 2)
    assert metrics["pg_clipfrac"].tolist() == [0.0, 5.0]
    assert metrics["pg_loss"].tolist() == pytest.approx([-1.0 * 3 + 2.0 * 2, 5.0])


def test_policy_gradient_on_policy_equals_advantage_weighted_score_function():
    logits, batch = _policy_batch()
    normalizer = LossNormalizer(num_samples=2, num_tokens=5)
    loss, _ = policy_loss(batch, LossConfig(loss_reduction="token_mean"), normalizer)
    (grad_loss,) = torch.autograd.grad(loss, logits, retain_graph=True)
    surrogate = -(batch["advantages"] * batch["log_probs"]).sum() / 5
    (grad_surrogate,) = torch.autograd.grad(surrogate, logits)
    torch.testing.assert_close(grad_loss, grad_surrogate)


def test_kl_loss_entropy_bonus_and_tis_each_change_the_loss_as_documented():
    normalizer = LossNormalizer(num_samples=2, num_tokens=5)
    _, batch = _policy_batch()
    base, _ = policy_loss(batch, LossConfig(loss_reduction="token_mean"), normalizer)
    kl_cfg = LossConfig(
        loss_reduction="token_mean", use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1"
    )
    with_kl, metrics = policy_loss(batch, kl_cfg, normalizer)
    assert with_kl.item() == pytest.approx(base.item() + 0.5 * 0.1)  # k1 = log p - log p_ref = 0.1
    assert metrics["kl_loss"].tolist() == pytest.approx([0.5, 5.0])
    ent_cfg = LossConfig(loss_reduction="token_mean", entropy_coef=0.01)
    with_entropy, _ = policy_loss(batch, ent_cfg, normalizer)
    assert with_entropy.item() == pytest.approx(base.item() - 0.01 * batch["entropy"].mean().item())
    tis_cfg = LossConfig(
        loss_reduction="token_mean", off_policy_correction="tis", tis_clip_high=2.0
    )
    with_tis, metrics = policy_loss(batch, tis_cfg, normalizer)
    # train/rollout ratio exp(-0.3) on every token, inside [0, 2]: the loss scales by it.
    assert with_tis.item() == pytest.approx(base.item() * math.exp(-0.3))
    assert metrics["off_policy_weight"][0].item() == pytest.approx(5 * math.exp(-0.3))


def test_off_policy_correction_without_rollout_log_probs_says_what_is_missing():
    _, batch = _policy_batch()
    del batch["rollout_log_probs"]
    with pytest.raises(
        ValueError, match=r"--off-policy-correction icepop needs the rollout engine's log-probs"
    ):
        policy_loss(
            batch,
            LossConfig(off_policy_correction="icepop"),
            LossNormalizer(num_samples=2, num_tokens=5),
        )


def test_sft_loss_is_the_mean_negative_log_likelihood():
    _, batch = _policy_batch()
    loss, metrics = sft_loss(
        batch,
        LossConfig(loss_type="sft_loss", loss_reduction="token_mean"),
        LossNormalizer(num_samples=2, num_tokens=5),
    )
    assert loss.item() == pytest.approx(-batch["log_probs"].mean().item())
    assert set(metrics) == {"sft_loss"}


def test_normalizer_rejects_impossible_counts():
    with pytest.raises(ValueError, match=r"got num_samples=0, num_tokens=3, dp_size=1"):
        LossNormalizer(num_samples=0, num_tokens=3)
