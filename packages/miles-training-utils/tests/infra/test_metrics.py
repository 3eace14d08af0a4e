"""Metric reduction: weighted means over micro-batches and over 2 gloo ranks holding uneven data.

References are float64 means computed in plain Python over the union of all ranks' data.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from miles.backends.training_utils.infra.metrics import (
    aggregate_forward_results,
    aggregate_train_losses,
    log_rollout_data,
    log_train_step,
    sample_weighted,
    token_weighted,
)
from tests.support.distributed import run_distributed

# Per rank: micro-batches of (per-token values, loss mask, per-sample KL). Rank 0 has 2
# micro-batches and 5 masked tokens, rank 1 one micro-batch and 2 masked tokens, so ranks weigh
# differently and the mean of per-rank means is not the mean over all tokens.
TRAIN_DATA: list[list[tuple[list[float], list[int], list[float]]]] = [
    [
        ([1.0, 2.0, 3.0, 100.0], [1, 1, 1, 0], [0.5, 0.25]),
        ([4.0, 5.0], [1, 1], [1.0]),
    ],
    [
        ([10.0, 20.0, -7.0], [1, 0, 1], [2.0, 4.0, 6.0, 8.0]),
    ],
]

# Per rank: a rollout shard. Rank 0 has 3 samples and 5 loss-masked tokens (rows as lists), rank 1
# has 1 sample and 2 masked tokens (rows as tensors); masked-out tokens hold outliers.
ROLLOUT_DATA: list[dict[str, list]] = [
    {
        "rewards": [1.0, 0.0, 0.0],
        "raw_reward": [1.0, -1.0, -1.0],
        "response_lengths": [2, 3, 1],
        "loss_mask": [[1, 1], [1, 0, 1], [1]],
        "old_log_probs": [[-0.5, -1.5], [-2.0, -9.0, -1.0], [-4.0]],
        "advantages": [[1.0, 1.0], [-0.5, -0.5, -0.5], [3.0]],
        "tokens": [[5, 6, 7], [8, 9, 10, 11], [12, 13]],  # not a metric: skipped
    },
    {
        "rewards": [1.0],
        "raw_reward": [1.0],
        "response_lengths": [5],
        "loss_mask": [torch.tensor([1, 1, 0, 0, 0])],
        "old_log_probs": [torch.tensor([-0.25, -0.25, -0.25, -0.25, -50.0])],
        "advantages": [torch.tensor([2.0, 2.0, 2.0, 2.0, 2.0])],
        "tokens": [[1, 2, 3, 4, 5, 6]],
    },
]


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def _train_reference(ranks: list) -> dict[str, float]:
    tokens = [
        v for rank in ranks for vals, mask, _ in rank for v, m in zip(vals, mask, strict=True) if m
    ]
    samples = [kl for rank in ranks for _, _, kls in rank for kl in kls]
    return {"pg_loss": _mean(tokens), "kl": _mean(samples)}


def _rollout_reference(shards: list[dict]) -> dict[str, float]:
    def column(key):
        return [float(x) for shard in shards for x in shard[key]]

    def masked(key):
        return [
            float(v)
            for shard in shards
            for row, mask in zip(shard[key], shard["loss_mask"], strict=True)
            for v, m in zip(list(row), list(mask), strict=True)
            if m
        ]

    return {
        "rollout/rewards": _mean(column("rewards")),
        "rollout/raw_reward": _mean(column("raw_reward")),
        "rollout/response_lengths": _mean(column("response_lengths")),
        "rollout/old_log_probs": _mean(masked("old_log_probs")),
        "rollout/advantages": _mean(masked("advantages")),
    }


def _train_pairs(micro_batches) -> list[dict[str, torch.Tensor]]:
    return [
        {
            "pg_loss": token_weighted(torch.tensor(vals), torch.tensor(mask)),
            "kl": sample_weighted(torch.tensor(kls)),
        }
        for vals, mask, kls in micro_batches
    ]


def _reduce_train_losses(rank: int, data) -> dict:
    pairs = _train_pairs(data[rank])
    return {
        "over_world": aggregate_train_losses(pairs, group=dist.group.WORLD),
        "group_none_is_local": aggregate_train_losses(pairs),
    }


def test_train_losses_over_uneven_ranks_equal_the_mean_over_all_tokens_and_samples():
    expected = _train_reference(TRAIN_DATA)
    rank_means = [_train_reference([rank]) for rank in TRAIN_DATA]
    naive = {key: _mean([means[key] for means in rank_means]) for key in expected}
    # The data must tell the right weighting from the naive one for every metric.
    for key in expected:
        assert abs(naive[key] - expected[key]) > 0.1, key

    results = run_distributed(_reduce_train_losses, 2, TRAIN_DATA)

    for rank, result in enumerate(results):
        assert result["over_world"] == pytest.approx(expected, rel=1e-12)
        assert result["group_none_is_local"] == pytest.approx(rank_means[rank], rel=1e-12)
    single = aggregate_train_losses(_train_pairs([mb for rank in TRAIN_DATA for mb in rank]))
    assert single == pytest.approx(expected, rel=1e-12)


def _rollout_metrics(rank: int, shards) -> dict[str, float]:
    return log_rollout_data(shards[rank], group=dist.group.WORLD)


def test_rollout_metrics_over_uneven_ranks_weigh_samples_and_masked_tokens():
    expected = _rollout_reference(ROLLOUT_DATA)
    rank_means = [_rollout_reference([shard]) for shard in ROLLOUT_DATA]
    naive = {key: _mean([means[key] for means in rank_means]) for key in expected}
    for key in expected:
        assert abs(naive[key] - expected[key]) > 0.1, key

    results = run_distributed(_rollout_metrics, 2, ROLLOUT_DATA)

    for result in results:
        assert result == pytest.approx(expected, rel=1e-12)
        assert sorted(result) == sorted(expected)  # "tokens" is not a metric
    union = {key: [row for shard in ROLLOUT_DATA for row in shard[key]] for key in ROLLOUT_DATA[0]}
    assert log_rollout_data(union) == pytest.approx(expected, rel=1e-12)


def _mismatched_keys(rank: int) -> str:
    metrics = {
        "loss": (1.0, 1.0),
        ("extra_on_rank0" if rank == 0 else "extra_on_rank1"): (1.0, 1.0),
    }
    with pytest.raises(ValueError) as error:
        aggregate_train_losses([metrics], group=dist.group.WORLD)
    return str(error.value)


def test_ranks_reporting_different_metrics_all_raise_naming_the_missing_keys():
    for message in run_distributed(_mismatched_keys, 2):
        assert "ranks report different metrics" in message
        assert "{0: ['extra_on_rank1'], 1: ['extra_on_rank0']}" in message


# ---------------------------------------------------------------- single process

finite = st.floats(-1e6, 1e6, allow_nan=False)


@given(
    rows=st.lists(
        st.lists(st.tuples(finite, st.booleans()), min_size=1, max_size=8), min_size=1, max_size=6
    ),
    cuts=st.lists(st.integers(0, 6), max_size=4),
)
def test_any_micro_batch_split_gives_the_mean_over_all_masked_tokens(rows, cuts):
    kept = [v for row in rows for v, m in row if m]
    bounds = sorted({0, len(rows), *(min(c, len(rows)) for c in cuts)})
    micro_batches = [rows[a:b] for a, b in itertools.pairwise(bounds)]
    losses = [
        {
            "loss": token_weighted(
                torch.tensor([v for row in mb for v, _ in row], dtype=torch.float64),
                torch.tensor([m for row in mb for _, m in row]),
            ),
            "per_sample": sample_weighted(
                torch.tensor([row[0][0] for row in mb], dtype=torch.float64)
            ),
        }
        for mb in micro_batches
    ]
    result = aggregate_train_losses(losses)
    if kept:
        assert result["loss"] == pytest.approx(_mean(kept), rel=1e-9, abs=1e-6)
    else:
        assert math.isnan(result["loss"])
    assert result["per_sample"] == pytest.approx(
        _mean([row[0][0] for row in rows]), rel=1e-9, abs=1e-6
    )


@given(values=st.lists(finite, min_size=1, max_size=20))
def test_token_weighted_with_a_full_mask_is_the_sum_and_count(values):
    x = torch.tensor(values, dtype=torch.float64)
    pair = token_weighted(x, torch.ones_like(x, dtype=torch.bool))
    assert pair.dtype == torch.float64 and pair.shape == (2,)
    assert pair.tolist() == pytest.approx([math.fsum(values), len(values)], rel=1e-9, abs=1e-6)


def test_pairs_are_detached_from_the_autograd_graph():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    assert not token_weighted(x * 2, torch.ones(2)).requires_grad
    assert not sample_weighted(x * 2).requires_grad


def test_token_weighted_rejects_a_mask_of_another_shape():
    with pytest.raises(ValueError, match=r"values shape \(2, 3\) != mask shape \(6,\)"):
        token_weighted(torch.zeros(2, 3), torch.ones(6))


def test_sample_weighted_rejects_per_token_matrices():
    with pytest.raises(ValueError, match=r"one value per sample .* got shape \(2, 3\)"):
        sample_weighted(torch.zeros(2, 3))


def test_pairs_may_be_given_as_tuples_and_bare_numbers_are_rejected():
    assert aggregate_train_losses([{"a": (3.0, 2.0)}, {"a": (1.0, 2.0)}]) == {"a": 1.0}
    with pytest.raises(ValueError, match=r"metric 'a' is 0\.5 .* \(weighted_sum, weight\) pair"):
        aggregate_train_losses([{"a": 0.5}])


def test_micro_batches_with_different_metrics_are_rejected():
    with pytest.raises(ValueError, match=r"micro-batch 1 has metrics \['b'\] but micro-batch 0"):
        aggregate_train_losses([{"a": (1.0, 1.0)}, {"b": (1.0, 1.0)}])
    with pytest.raises(ValueError, match="no micro-batches"):
        aggregate_train_losses([])


def test_a_metric_without_weight_is_nan_rather_than_an_error():
    result = aggregate_train_losses([{"a": token_weighted(torch.ones(3), torch.zeros(3))}])
    assert math.isnan(result["a"])


@given(
    lengths=st.lists(st.integers(0, 5), min_size=1, max_size=5),
    width=st.integers(1, 3),
)
def test_forward_results_concatenate_micro_batches_in_order(lengths, width):
    total = sum(lengths)
    log_probs = torch.arange(total, dtype=torch.float32)  # (T,)
    hidden = torch.arange(total * width, dtype=torch.float32).reshape(total, width)  # (T, width)
    splits = list(zip(log_probs.split(lengths), hidden.split(lengths), strict=True))
    merged = aggregate_forward_results([{"log_probs": lp, "hidden": h} for lp, h in splits])
    assert torch.equal(merged["log_probs"], log_probs)
    assert torch.equal(merged["hidden"], hidden)


def test_forward_results_reject_scalars_mismatched_keys_and_shapes():
    assert aggregate_forward_results([]) == {}
    with pytest.raises(ValueError, match="'loss' of micro-batch 1 is a scalar"):
        aggregate_forward_results([{"loss": torch.ones(2)}, {"loss": torch.tensor(1.0)}])
    with pytest.raises(ValueError, match=r"micro-batch 1 has keys \['b'\] but micro-batch 0 has"):
        aggregate_forward_results([{"a": torch.ones(1)}, {"b": torch.ones(1)}])
    with pytest.raises(ValueError, match=r"cannot concatenate 'a' .* \[\(1, 2\), \(1, 3\)\]"):
        aggregate_forward_results([{"a": torch.ones(1, 2)}, {"a": torch.ones(1, 3)}])


def test_rollout_token_columns_need_a_loss_mask_of_matching_lengths():
    with pytest.raises(
        ValueError, match=r"per-token columns \['old_log_probs'\] but no 'loss_mask'"
    ):
        log_rollout_data({"old_log_probs": [[0.0]]})
    with pytest.raises(
        ValueError, match="'old_log_probs', sample 1: 2 per-token values but 'loss_mask' has 3"
    ):
        log_rollout_data({"old_log_probs": [[0.0], [0.0, 1.0]], "loss_mask": [[1], [1, 1, 1]]})
    with pytest.raises(ValueError, match="'old_log_probs' has 1 samples but 'loss_mask' has 2"):
        log_rollout_data({"old_log_probs": [[0.0]], "loss_mask": [[1], [1]]})
    with pytest.raises(ValueError, match=r"'advantages', sample 0 is 0\.5; per-token columns"):
        log_rollout_data({"advantages": [0.5], "loss_mask": [[1]]})


def test_train_step_metrics_are_prefixed_and_carry_step_lr_and_grad_norm():
    logged = log_train_step({"pg_loss": 0.5, "train/kl": 0.1}, step=7, lr=1e-6, grad_norm=2.5)
    assert logged == {
        "train/step": 7.0,
        "train/lr": 1e-6,
        "train/grad_norm": 2.5,
        "train/pg_loss": 0.5,
        "train/kl": 0.1,
    }
    with pytest.raises(ValueError, match="metric 'lr' would overwrite 'train/lr'"):
        log_train_step({"lr": 1.0}, step=0, lr=1e-6, grad_norm=1.0)
