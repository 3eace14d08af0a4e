"""Training and rollout metrics reduced across ranks with the right weights.

Every metric travels as a (weighted_sum, weight) pair and is divided only after the pairs of all
micro-batches and ranks are summed, so ranks with more tokens or samples count for more. Averaging
per-rank means instead is wrong whenever ranks hold uneven data. Writing the metrics to a tracker
is left to the caller.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from miles.backends.training_utils.infra.device import current_device

logger = logging.getLogger(__name__)

MetricPair = torch.Tensor | tuple[float, float]
"""(weighted_sum, weight): a tensor of shape (2,) or a pair of numbers."""

# Rollout columns averaged over samples, and over loss-masked tokens, by `log_rollout_data`.
# Any other column (tokens, indices, metadata) is not a metric and is skipped.
SAMPLE_KEYS: tuple[str, ...] = ("rewards", "raw_reward", "response_lengths")
TOKEN_KEYS: tuple[str, ...] = (
    "rollout_log_probs",
    "old_log_probs",
    "ref_log_probs",
    "advantages",
    "returns",
    "values",
)
LOSS_MASK_KEY = "loss_mask"


def token_weighted(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum of values over masked tokens, number of masked tokens] as a float64 tensor (2,).

    `mask` has the shape of `values` and holds 1 for tokens that count and 0 for the rest.
    """
    if values.shape != mask.shape:
        raise ValueError(
            f"token_weighted: values shape {tuple(values.shape)} != mask shape "
            f"{tuple(mask.shape)}; pass one mask entry per token value"
        )
    values = values.detach().to(torch.float64)
    mask = mask.detach().to(device=values.device, dtype=torch.float64)
    return torch.stack([(values * mask).sum(), mask.sum()])


def sample_weighted(per_sample_values: torch.Tensor) -> torch.Tensor:
    """[sum over samples, number of samples] as a float64 tensor (2,); one value per sample."""
    if per_sample_values.dim() > 1:
        raise ValueError(
            f"sample_weighted expects one value per sample (a 1-D tensor), got shape "
            f"{tuple(per_sample_values.shape)}; for per-token values use token_weighted(values, mask)"
        )
    values = per_sample_values.detach().to(torch.float64).reshape(-1)
    return torch.stack([values.sum(), values.new_tensor(float(values.numel()))])


def aggregate_forward_results(
    per_micro_batch: list[dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """Concatenate each key's per-token or per-sample tensors along dim 0, micro-batches in order.

    Every micro-batch must carry the same keys. Scalars cannot be concatenated: reduce them with
    `aggregate_train_losses` instead.
    """
    if not per_micro_batch:
        return {}
    keys = list(per_micro_batch[0])
    for index, results in enumerate(per_micro_batch):
        if set(results) != set(keys):
            raise ValueError(
                f"micro-batch {index} has keys {sorted(results)} but micro-batch 0 has "
                f"{sorted(keys)}; every micro-batch's forward must return the same keys"
            )
    merged = {}
    for key in keys:
        parts = [results[key] for results in per_micro_batch]
        for index, part in enumerate(parts):
            if part.dim() == 0:
                raise ValueError(
                    f"{key!r} of micro-batch {index} is a scalar; forward results are per token "
                    "or per sample (dim 0); reduce scalars with aggregate_train_losses"
                )
        try:
            merged[key] = torch.cat(parts, dim=0)
        except RuntimeError as error:
            shapes = [tuple(part.shape) for part in parts]
            raise ValueError(
                f"cannot concatenate {key!r} along dim 0: micro-batch shapes {shapes} differ "
                "beyond dim 0"
            ) from error
    return merged


def aggregate_train_losses(
    losses: Sequence[Mapping[str, MetricPair]], *, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Weighted mean of each metric over all micro-batches and all ranks of `group`.

    Each micro-batch maps metric name -> (weighted_sum, weight), e.g. from `token_weighted` or
    `sample_weighted`. Sums and weights are added up over micro-batches, then over ranks in one
    all_reduce, and divided at the end; a metric whose total weight is 0 comes out as NaN.
    `group` is the axis whose ranks hold different data, normally
    the backend's `ParallelState.dp_cp.group`; None means this process alone (no communication), as in
    `GroupInfo`. Every rank of `group` must call this with the same metric names.
    """
    if not losses:
        raise ValueError(
            "aggregate_train_losses got no micro-batches; pass one dict of metric pairs per "
            "micro-batch"
        )
    # Sorted so the packed tensor lines up element by element on every rank.
    keys = sorted(losses[0])
    for index, metrics in enumerate(losses):
        if sorted(metrics) != keys:
            raise ValueError(
                f"micro-batch {index} has metrics {sorted(metrics)} but micro-batch 0 has "
                f"{keys}; every micro-batch must report the same metrics"
            )
    device = _collective_device(group, losses[0].values())
    packed = torch.zeros(len(keys), 2, dtype=torch.float64, device=device)  # (M, [sum, weight])
    for metrics in losses:
        for row, key in enumerate(keys):
            packed[row] += _as_pair(key, metrics[key]).to(device)
    if group is not None:
        _check_same_keys(keys, group)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    totals = packed.tolist()
    empty = [key for key, (_, weight) in zip(keys, totals, strict=True) if weight == 0]
    if empty:
        logger.warning("metrics with zero total weight (no tokens or samples) are NaN: %s", empty)
    return {
        key: (total / weight if weight != 0 else math.nan)
        for key, (total, weight) in zip(keys, totals, strict=True)
    }


def log_rollout_data(
    rollout_data: Mapping[str, Sequence], *, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Rollout metrics over all ranks of `group`, as `{"rollout/<key>": mean}`.

    Sample-weighted means of `SAMPLE_KEYS` (one number per sample) and token-weighted means of
    `TOKEN_KEYS` over loss-masked tokens (one row of per-token values per sample, a list or a 1-D
    tensor, aligned with the row of `loss_mask`). Other columns are skipped. `group` as in
    `aggregate_train_losses`; every rank must hold the same columns.
    """
    pairs: dict[str, torch.Tensor] = {}
    for key in SAMPLE_KEYS:
        if key in rollout_data:
            pairs[key] = sample_weighted(_as_flat_tensor(key, rollout_data[key]))
    token_keys = [key for key in TOKEN_KEYS if key in rollout_data]
    if token_keys:
        if LOSS_MASK_KEY not in rollout_data:
            raise ValueError(
                f"rollout data has per-token columns {token_keys} but no {LOSS_MASK_KEY!r}; "
                f"token means are taken over loss-masked tokens, so pass {LOSS_MASK_KEY!r}"
            )
        masks = rollout_data[LOSS_MASK_KEY]
        mask = _as_flat_tensor(LOSS_MASK_KEY, masks)
        for key in token_keys:
            _check_rows_match_masks(key, rollout_data[key], masks)
            pairs[key] = token_weighted(_as_flat_tensor(key, rollout_data[key]), mask)
    means = aggregate_train_losses([pairs], group=group)
    return {f"rollout/{key}": value for key, value in means.items()}


def log_train_step(
    metrics: Mapping[str, float], *, step: int, lr: float, grad_norm: float
) -> dict[str, float]:
    """`{"train/<name>": value}` for one optimizer step, plus step, learning rate and grad norm.

    Names already prefixed with "train/" keep their prefix.
    """
    logged = {
        "train/step": float(step),
        "train/lr": float(lr),
        "train/grad_norm": float(grad_norm),
    }
    for name, value in metrics.items():
        key = name if name.startswith("train/") else f"train/{name}"
        if key in logged:
            raise ValueError(
                f"metric {name!r} would overwrite {key!r}, which log_train_step fills from its "
                "keyword arguments; rename the metric"
            )
        logged[key] = float(value)
    return logged


def _as_pair(key: str, value: MetricPair) -> torch.Tensor:
    pair = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value)
    if pair.shape != (2,):
        raise ValueError(
            f"metric {key!r} is {value!r} (shape {tuple(pair.shape)}); each metric must be a "
            "(weighted_sum, weight) pair of shape (2,): build it with token_weighted(values, mask) "
            "or sample_weighted(per_sample_values)"
        )
    return pair.to(torch.float64)


def _collective_device(group: dist.ProcessGroup | None, values) -> torch.device:
    """Where the packed metrics must live for `group`'s backend: CPU for gloo, else the device
    the metrics were computed on."""
    if group is None or dist.get_backend(group) == dist.Backend.GLOO:
        return torch.device("cpu")
    for value in values:
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            return value.device
    # Metrics given as plain numbers: use the accelerator this rank set as current.
    return current_device()


def _check_same_keys(keys: list[str], group: dist.ProcessGroup) -> None:
    # A cheap object gather before the all_reduce: summing packed tensors whose rows mean
    # different metrics on different ranks would succeed and log garbage.
    gathered: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, keys, group=group)
    if any(other != keys for other in gathered):
        union = sorted(set().union(*(set(k or ()) for k in gathered)))
        missing = {}
        for rank, rank_keys in enumerate(gathered):
            absent = [key for key in union if key not in set(rank_keys or ())]
            if absent:
                missing[rank] = absent
        raise ValueError(
            f"ranks report different metrics, missing per rank (rank within the group): {missing}; "
            f"keys per rank: {dict(enumerate(gathered))}. Every rank must report the same metric "
            "names, even when it has no data for one (report a zero-weight pair)"
        )


def _as_flat_tensor(key: str, column: Sequence) -> torch.Tensor:
    """One float64 vector from a column of numbers, 0-d tensors, or per-sample rows."""
    if isinstance(column, torch.Tensor):
        return column.detach().to(torch.float64).reshape(-1)
    rows = []
    for index, item in enumerate(column):
        row = item.detach() if isinstance(item, torch.Tensor) else torch.tensor(item)
        if row.dim() > 1:
            raise ValueError(
                f"rollout column {key!r}, sample {index}: shape {tuple(row.shape)}; each sample "
                "holds a number or a 1-D row of per-token values"
            )
        rows.append(row.to(device="cpu", dtype=torch.float64).reshape(-1))
    if not rows:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat(rows)


def _row_lengths(key: str, column: Sequence) -> list[int]:
    lengths = []
    for index, row in enumerate(column):
        if isinstance(row, torch.Tensor) and row.dim() == 1:
            lengths.append(row.numel())
        elif not isinstance(row, torch.Tensor) and isinstance(row, Sequence):
            lengths.append(len(row))
        else:
            raise ValueError(
                f"rollout column {key!r}, sample {index} is {row!r}; per-token columns hold one "
                "row (a list or a 1-D tensor) of per-token values per sample"
            )
    return lengths


def _check_rows_match_masks(key: str, rows: Sequence, masks: Sequence) -> None:
    if len(rows) != len(masks):
        raise ValueError(
            f"rollout column {key!r} has {len(rows)} samples but {LOSS_MASK_KEY!r} has "
            f"{len(masks)}; every column holds one entry per sample"
        )
    for index, (length, mask_length) in enumerate(
        zip(_row_lengths(key, rows), _row_lengths(LOSS_MASK_KEY, masks), strict=True)
    ):
        if length != mask_length:
            raise ValueError(
                f"rollout column {key!r}, sample {index}: {length} per-token values but "
                f"{LOSS_MASK_KEY!r} has {mask_length}; both must cover the same response tokens"
            )
