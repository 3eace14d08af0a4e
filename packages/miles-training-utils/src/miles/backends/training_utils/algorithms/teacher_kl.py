"""The teacher KL of on-policy distillation, per token, and the ways it enters training.

On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models"; the
Thinking Machines recipe that upstream miles and slime follow): the student samples y ~ p_student
and a teacher scores the same tokens. `log p_student(y_t) - log p_teacher(y_t)` is a one-sample
estimate of the per-token reverse KL(p_student || p_teacher). The student log-probs are those of
the policy that sampled (the old policy's, or the engine's with --use-rollout-logprobs), so the
KL is a fixed number per token, as a reward is:

- advantages (upstream): A_t <- A_t - coef * KL_t, after the estimator, on trainable tokens;
- loss: + coef * reduce(r_t * KL_t) with r_t = exp(log p - log p_old), whose value is the KL at
  the step's start and whose gradient, E[KL_t * grad log p(y_t)], is the reverse KL's.

Both learn only from the tokens the student sampled, so a student whose samples the teacher
never agrees with (a randomly initialised one) gets almost no signal. The third way is dense:

- topk: + coef * reduce(sum_j p_T(j) (log p_T(j) - log p_S(j))) over the teacher's K likeliest
  tokens j at each position of the student's samples: the forward KL from the teacher's top-K
  (the supervised distillation of GKD, Agarwal et al. 2024, on the student's own prefixes),
  whose gradient moves the student's mass onto the teacher's tokens whatever it sampled.
"""

from __future__ import annotations

import torch
from torch import Tensor


def reverse_kl(student_log_probs: Tensor, teacher_log_probs: Tensor) -> Tensor:
    """(R,) per-token `log p_student(y_t) - log p_teacher(y_t)` of sampled tokens y_t."""
    if student_log_probs.shape != teacher_log_probs.shape:
        raise ValueError(
            f"student log-probs {tuple(student_log_probs.shape)} and teacher log-probs "
            f"{tuple(teacher_log_probs.shape)} must cover the same response tokens"
        )
    return student_log_probs - teacher_log_probs.to(student_log_probs.dtype)


def penalize_advantages(
    advantages: list[Tensor],
    student_log_probs: list[Tensor],
    teacher_log_probs: list[Tensor],
    masks: list[Tensor],
    *,
    coef: float,
) -> list[Tensor]:
    """Per sample (R,): A_t - coef * KL_t on trainable tokens (mask 1); A_t where the mask is 0
    (tool output and other tokens the student did not sample need no KL)."""
    out = []
    for adv, student, teacher, mask in zip(
        advantages, student_log_probs, teacher_log_probs, masks, strict=True
    ):
        kl = reverse_kl(torch.as_tensor(student).double(), torch.as_tensor(teacher).double())
        penalty = coef * kl * torch.as_tensor(mask).double()  # (R,)
        out.append((adv.double() - penalty).to(adv.dtype))
    return out


def kl_loss_per_token(
    log_probs: Tensor, old_log_probs: Tensor, teacher_log_probs: Tensor
) -> Tensor:
    """(T,) loss-mode term `exp(log p - log p_old) * (log p_old - log p_teacher)`: gradients flow
    through `log_probs` only; at the step's start (log p = log p_old) it equals the KL."""
    kl = reverse_kl(old_log_probs, teacher_log_probs).detach()
    ratio = torch.exp(log_probs - old_log_probs.detach())
    return ratio * kl


def topk_forward_kl(student_top_log_probs: Tensor, teacher_top_log_probs: Tensor) -> Tensor:
    """(T,) `sum_j p_T(j) (log p_T(j) - log p_S(j))` over the teacher's K tokens j of each
    position, from (T, K) log-probs of the same ids; gradients flow through the student's."""
    if student_top_log_probs.shape != teacher_top_log_probs.shape:
        raise ValueError(
            f"student log-probs {tuple(student_top_log_probs.shape)} of the teacher's top tokens "
            f"and the teacher's {tuple(teacher_top_log_probs.shape)} must cover the same tokens"
        )
    teacher = teacher_top_log_probs.to(student_top_log_probs.dtype)
    return (teacher.exp() * (teacher - student_top_log_probs)).sum(-1)
