"""The training loss of one micro-batch, reduced so the global batch's gradient is what it is.

Reductions (l = per-token loss, m = loss mask, over the *global* batch of N samples):
  sample_mean:  (1/N) * sum_i [ sum_t l_it m_it / max(1, sum_t m_it) ]
  token_mean:   sum_it l_it m_it / sum_it m_it
  constant:     sum_it l_it m_it / (N * C)          (Dr.GRPO, C = --loss-constant-normalizer)
Every micro-batch divides by global counts (`LossNormalizer`), never by its own, so summing
micro-batch gradients gives the same gradient for any micro-batch size. The result is multiplied
by the data-parallel size because FSDP and Megatron *average* gradients over data-parallel ranks.
The built-in losses (`policy_loss`, `sft_loss`) are registered in `registry.LOSSES`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from miles.backends.training_utils.algorithms.formulas.kl import compute_approx_kl
from miles.backends.training_utils.algorithms.formulas.off_policy import (
    compute_icepop_weights,
    compute_mis_weights,
    compute_tis_weights,
)
from miles.backends.training_utils.algorithms.formulas.policy_losses import (
    compute_gspo_kl,
    compute_policy_loss,
    compute_sft_loss,
    compute_value_loss,
)
from miles.backends.training_utils.infra.metrics import token_weighted

if TYPE_CHECKING:
    from miles.backends.training_utils.algorithms.loss_config import LossConfig

__all__ = ["LossNormalizer", "policy_loss", "reduce_loss", "sft_loss", "value_loss_function"]


@dataclass(frozen=True, kw_only=True)
class LossNormalizer:
    """Counts over the whole global batch (every micro-batch, every data-parallel rank)."""

    num_samples: int
    """Samples in the global batch."""
    num_tokens: int
    """Trainable (loss-mask = 1) tokens in the global batch."""
    dp_size: int = 1
    """Data-parallel ranks whose gradients the backend averages."""

    def __post_init__(self) -> None:
        if self.num_samples < 1 or self.num_tokens < 0 or self.dp_size < 1:
            raise ValueError(
                f"LossNormalizer needs num_samples >= 1, num_tokens >= 0, dp_size >= 1; got "
                f"num_samples={self.num_samples}, num_tokens={self.num_tokens}, dp_size={self.dp_size}"
            )


def reduce_loss(
    per_token: Tensor,
    loss_mask: Tensor,
    response_lengths: Sequence[int],
    *,
    config: LossConfig,
    normalizer: LossNormalizer,
) -> Tensor:
    """Reduce (T,) per-token values of this micro-batch's responses to its share of the global loss."""
    masked = per_token * loss_mask  # (T,)
    if config.loss_reduction == "sample_mean":
        sample_ids = torch.repeat_interleave(
            torch.arange(len(response_lengths), device=per_token.device),
            torch.as_tensor(response_lengths, device=per_token.device),
        )  # (T,)
        sums = torch.zeros(len(response_lengths), dtype=masked.dtype, device=masked.device)
        counts = torch.zeros_like(sums)
        sums.index_add_(0, sample_ids, masked)
        counts.index_add_(0, sample_ids, loss_mask.to(masked.dtype))
        total = (sums / counts.clamp(min=1)).sum() / normalizer.num_samples
    elif config.loss_reduction == "token_mean":
        total = masked.sum() / max(normalizer.num_tokens, 1)
    else:
        total = masked.sum() / (normalizer.num_samples * config.loss_constant_normalizer)
    return total * normalizer.dp_size


def _off_policy_weights(
    batch: dict, config: LossConfig, old_log_probs: Tensor
) -> tuple[Tensor, dict]:
    """Importance weights between the train-side old policy and the engine that sampled."""
    if "rollout_log_probs" not in batch:
        raise ValueError(
            f"--off-policy-correction {config.off_policy_correction} needs the rollout engine's "
            "log-probs; the batch has no 'rollout_log_probs' (request return_logprob in rollout)"
        )
    rollout = batch["rollout_log_probs"]
    if config.off_policy_correction == "tis":
        weights = compute_tis_weights(
            old_log_probs, rollout, config.tis_clip_low, config.tis_clip_high
        )
        return weights, {}
    if config.off_policy_correction == "icepop":
        weights = compute_icepop_weights(
            old_log_probs, rollout, config.icepop_low, config.tis_clip_high
        )
        return weights, {}
    masks = list(batch["loss_mask"].split(list(batch["response_lengths"])))
    weights, keep = compute_mis_weights(
        old_log_probs,
        rollout,
        masks,
        list(batch["response_lengths"]),
        config.tis_clip_high,
        config.mis_veto_threshold,
    )
    return weights, {"mis_kept_fraction": torch.stack([keep.sum(), torch.tensor(float(len(keep)))])}


def sft_loss(
    batch: dict, config: LossConfig, normalizer: LossNormalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """Negative log-likelihood of the response tokens (supervised fine-tuning).

    `batch` holds (T,) tensors over the micro-batch's response tokens, samples concatenated:
    `log_probs` (with grad) and `loss_mask`; `response_lengths` lists each sample's token count.
    """
    log_probs, mask = batch["log_probs"], batch["loss_mask"].to(batch["log_probs"].dtype)
    per_token = compute_sft_loss(log_probs)
    loss = reduce_loss(
        per_token, mask, list(batch["response_lengths"]), config=config, normalizer=normalizer
    )
    return loss, {"sft_loss": token_weighted(per_token.detach(), mask)}


def policy_loss(
    batch: dict, config: LossConfig, normalizer: LossNormalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped policy-gradient loss of one micro-batch and its metrics as (sum, weight) pairs.

    `batch` holds (T,) tensors over the micro-batch's response tokens, samples concatenated:
    `log_probs` and `entropy` (current policy, with grad), `loss_mask`, `old_log_probs`,
    `advantages`, plus `ref_log_probs` (--use-kl-loss) and `rollout_log_probs`
    (--off-policy-correction); `response_lengths` lists each sample's token count.
    """
    log_probs, mask = batch["log_probs"], batch["loss_mask"].to(batch["log_probs"].dtype)
    lengths = list(batch["response_lengths"])

    def reduce(values: Tensor) -> Tensor:
        return reduce_loss(values, mask, lengths, config=config, normalizer=normalizer)

    old_log_probs = batch["old_log_probs"]
    if config.advantage_estimator == "gspo":
        split_masks = list(mask.split(lengths))
        ppo_kl = compute_gspo_kl(log_probs, old_log_probs, split_masks, lengths)
    else:
        ppo_kl = old_log_probs - log_probs
    pg_per_token, clipfrac = compute_policy_loss(
        ppo_kl, batch["advantages"], config.eps_clip, config.eps_clip_high, config.eps_clip_c
    )
    metrics: dict[str, Tensor] = {}
    if config.off_policy_correction is not None:
        weights, extra = _off_policy_weights(batch, config, old_log_probs)
        pg_per_token = pg_per_token * weights
        metrics.update(extra)
        metrics["off_policy_weight"] = token_weighted(weights, mask)
    loss = reduce(pg_per_token)
    entropy = batch["entropy"]
    if config.entropy_coef:
        loss = loss - config.entropy_coef * reduce(entropy)
    if config.use_kl_loss:
        kl = compute_approx_kl(log_probs, batch["ref_log_probs"], config.kl_loss_type)
        loss = loss + config.kl_loss_coef * reduce(kl)
        metrics["kl_loss"] = token_weighted(kl.detach(), mask)
    metrics.update(
        pg_loss=token_weighted(pg_per_token.detach(), mask),
        pg_clipfrac=token_weighted(clipfrac, mask),
        ppo_kl=token_weighted(ppo_kl.detach(), mask),
        entropy=token_weighted(entropy.detach(), mask),
    )
    return loss, metrics


def value_loss_function(
    batch: dict, config: LossConfig, normalizer: LossNormalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """The critic's clipped value loss (ppo): `values` (with grad), `old_values`, `returns`."""
    mask = batch["loss_mask"].to(batch["values"].dtype)
    per_token, clipfrac = compute_value_loss(
        batch["values"], batch["old_values"], batch["returns"], config.value_clip
    )
    loss = reduce_loss(
        per_token, mask, list(batch["response_lengths"]), config=config, normalizer=normalizer
    )
    return loss, {
        "value_loss": token_weighted(per_token.detach(), mask),
        "value_clipfrac": token_weighted(clipfrac, mask),
    }
