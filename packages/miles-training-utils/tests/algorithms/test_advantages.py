"""Reward shaping and advantages per estimator, against float64 references; global whitening
across 2 real gloo ranks equals whitening the union in one process."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.training_utils.algorithms.advantages import global_whiten
from miles.backends.training_utils.algorithms.algorithm import (
    compute_advantages_and_returns,
    shape_rewards,
)
from miles.backends.training_utils.algorithms.loss_config import LossConfig
from tests.support.distributed import run_distributed


def _ref_shape(rewards, group_size, estimator):
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = sum(group) / len(group)
        for i, r in enumerate(group):
            if estimator == "grpo":
                std = (
                    math.sqrt(sum((g - mean) ** 2 for g in group) / (len(group) - 1))
                    if len(group) > 1
                    else 0.0
                )
                out.append(0.0 if std == 0.0 else (r - mean) / (std + 1e-6))
            elif estimator in ("dr_grpo", "reinforce_plus_plus_baseline"):
                out.append(r - mean)
            elif estimator == "rloo":
                others = [g for j, g in enumerate(group) if j != i]
                out.append(r - sum(others) / len(others) if others else 0.0)
            else:
                out.append(r)
    return out


@settings(max_examples=60, deadline=None)
@given(
    group_size=st.integers(1, 5),
    num_groups=st.integers(1, 4),
    estimator=st.sampled_from(
        ["grpo", "dr_grpo", "reinforce_plus_plus_baseline", "rloo", "reinforce_plus_plus"]
    ),
    data=st.data(),
)
def test_shape_rewards_matches_reference(group_size, num_groups, estimator, data):
    rewards = data.draw(
        st.lists(
            st.sampled_from([0.0, 1.0, 0.5, -2.0, 7.25]),
            min_size=group_size * num_groups,
            max_size=group_size * num_groups,
        )
    )
    extra = (
        {"loss_reduction": "constant", "loss_constant_normalizer": 8}
        if estimator == "dr_grpo"
        else {}
    )
    config = LossConfig(advantage_estimator=estimator, **extra)
    shaped = shape_rewards(
        torch.tensor(rewards, dtype=torch.float64), config, group_size=group_size
    )
    assert torch.isfinite(shaped).all()
    assert shaped.tolist() == pytest.approx(_ref_shape(rewards, group_size, estimator), abs=1e-9)


def _batch(rewards, masks, **extra):
    return {"rewards": list(rewards), "loss_mask": [list(m) for m in masks], **extra}


def test_grpo_family_puts_the_sample_reward_on_every_token():
    batch = _batch([0.5, -1.0], [[1, 1, 0], [1]])
    compute_advantages_and_returns(batch, LossConfig())
    assert [a.tolist() for a in batch["advantages"]] == [[0.5, 0.5, 0.5], [-1.0]]


def _ref_reinforce_pp(rewards, masks, log_probs, ref_log_probs, kl_coef, gamma):
    """Token rewards, return-to-go over trainable tokens, then whitening over all of them."""
    returns = []
    for reward, mask, lp, ref in zip(rewards, masks, log_probs, ref_log_probs, strict=True):
        token_rewards = [-kl_coef * (a - b) for a, b in zip(lp, ref, strict=True)]
        trainable = [t for t, m in enumerate(mask) if m]
        if trainable:
            token_rewards[trainable[-1]] += reward
        ret, running = [0.0] * len(mask), 0.0
        for t in reversed(trainable):
            running = token_rewards[t] + gamma * running
            ret[t] = running
        returns.append(ret)
    values = [
        r
        for ret, mask in zip(returns, masks, strict=True)
        for r, m in zip(ret, mask, strict=True)
        if m
    ]
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return [
        [(r - mean) / math.sqrt(var + 1e-8) if m else 0.0 for r, m in zip(ret, mask, strict=True)]
        for ret, mask in zip(returns, masks, strict=True)
    ]


def test_reinforce_plus_plus_with_kl_and_discount_matches_reference():
    gen = torch.Generator().manual_seed(3)
    masks = [[1, 1, 0, 1], [1, 0, 1], [0, 1]]
    lp = [torch.randn(len(m), generator=gen, dtype=torch.float64).tolist() for m in masks]
    ref = [torch.randn(len(m), generator=gen, dtype=torch.float64).tolist() for m in masks]
    batch = _batch([1.0, 0.0, 0.5], masks, old_log_probs=lp, ref_log_probs=ref)
    config = LossConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.1, gamma=0.9)
    compute_advantages_and_returns(batch, config)
    expected = _ref_reinforce_pp([1.0, 0.0, 0.5], masks, lp, ref, 0.1, 0.9)
    for got, want in zip(batch["advantages"], expected, strict=True):
        assert got.tolist() == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_ppo_advantages_skip_masked_tokens_and_add_values_to_returns():
    batch = _batch([1.0], [[1, 0, 1]], values=[[0.2, 9.0, 0.5]])
    compute_advantages_and_returns(
        batch, LossConfig(advantage_estimator="ppo", gamma=1.0, lambd=1.0)
    )
    # Trainable tokens 0 and 2: reward 1 on token 2, value after it 0; the masked token is skipped.
    assert batch["advantages"][0].tolist() == pytest.approx([1.0 - 0.2, 0.0, 1.0 - 0.5])
    assert batch["returns"][0].tolist() == pytest.approx([1.0, 0.0, 1.0])


SHARDS = [
    ([[1.0, 2.0, 3.0], [4.0]], [[1, 1, 0], [1]]),
    ([[10.0, -1.0], [0.5, 0.5, 0.5, 2.0]], [[1, 1], [1, 0, 1, 1]]),
]


def _whiten_shard(rank: int, shards) -> list[list[float]]:
    values, masks = shards[rank]
    out = global_whiten(
        [torch.tensor(v, dtype=torch.float64) for v in values],
        [torch.tensor(m, dtype=torch.float64) for m in masks],
    )
    return [o.tolist() for o in out]


def test_whitening_across_two_gloo_ranks_uses_global_statistics():
    per_rank = run_distributed(_whiten_shard, 2, SHARDS)
    all_values = [torch.tensor(v, dtype=torch.float64) for shard in SHARDS for v in shard[0]]
    all_masks = [torch.tensor(m, dtype=torch.float64) for shard in SHARDS for m in shard[1]]
    single = [x for o in global_whiten(all_values, all_masks) for x in o.tolist()]
    assert [x for rows in per_rank for row in rows for x in row] == pytest.approx(single)
    # Whitening each shard on its own would give a different answer: the reduction matters.
    local = [x for o in global_whiten(all_values[:2], all_masks[:2]) for x in o.tolist()]
    assert local != pytest.approx(single[:4])


def _collective_device_and_global_whiten(rank: int) -> tuple[str, list[float]]:
    import torch

    from miles.backends.training_utils.algorithms.advantages import global_whiten
    from miles.backends.training_utils.infra.device import collective_device

    values = [torch.tensor([float(rank), float(rank + 2)])]
    whitened = global_whiten(values, [torch.ones(2)])
    return str(collective_device()), whitened[0].tolist()


def test_gloo_collectives_take_cpu_tensors_and_whitening_uses_every_ranks_tokens():
    (device0, white0), (device1, white1) = run_distributed(_collective_device_and_global_whiten, 2)
    assert device0 == device1 == "cpu"
    # Tokens 0, 2 | 1, 3: mean 1.5, population std sqrt(1.25).
    assert white0 == pytest.approx([-1.5 / 1.25**0.5, 0.5 / 1.25**0.5], rel=1e-6)
    assert white1 == pytest.approx([-0.5 / 1.25**0.5, 1.5 / 1.25**0.5], rel=1e-6)
