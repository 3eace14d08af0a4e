"""Per-token estimators of the KL divergence to a reference policy (k1, k2, k3, low_var_kl).

The estimator names are `--kl-loss-type`'s choices, declared with the rest of the algorithm
settings in `loss_config`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles.backends.training_utils.algorithms.formulas._segments import _check_same_shape
from miles.backends.training_utils.algorithms.loss_config import KL_TYPES, KLType

# exp(20) ~ 4.9e8: keeps the k3 estimator finite when the reference model is far more likely.
_K3_MAX_NEG_LOG_RATIO = 20.0
# verl and slime clamp low_var_kl to this range.
_LOW_VAR_KL_BOUND = 10.0

__all__ = ["compute_approx_kl"]


def compute_approx_kl(log_probs: Tensor, ref_log_probs: Tensor, kl_type: KLType) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating KL").

    With x = log_probs - ref_log_probs: k1 = x; k2 = x^2 / 2; k3 = exp(-x) - 1 + x. `low_var_kl`
    is k3 clamped to [-10, 10], as verl and slime do. For k3 and low_var_kl, -x is first clamped
    to at most 20 (in both terms) to keep exp finite; beyond that point the value is constant and
    its gradient zero. k3 is computed as expm1(-x) + x, clamped at 0 against rounding, so it is
    accurate for tiny x and never negative.
    """
    _check_same_shape("log_probs", log_probs, "ref_log_probs", ref_log_probs)
    log_ratio = log_probs - ref_log_probs  # same shape as log_probs
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio.square()
    if kl_type in ("k3", "low_var_kl"):
        neg = (-log_ratio).clamp(max=_K3_MAX_NEG_LOG_RATIO)
        kl = (torch.expm1(neg) - neg).clamp(min=0.0)
        if kl_type == "low_var_kl":
            kl = kl.clamp(min=-_LOW_VAR_KL_BOUND, max=_LOW_VAR_KL_BOUND)
        return kl
    raise ValueError(f"unknown kl_type {kl_type!r} (--kl-loss-type); choose one of {KL_TYPES}")
