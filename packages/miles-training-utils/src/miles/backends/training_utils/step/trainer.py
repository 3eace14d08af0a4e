"""`PolicyTrainer`: one rollout's RL (or SFT) optimizer steps, written once for every backend.

Given this rank's shard of a rollout and a `TrainEngine`, it splits the shard into optimizer
steps, computes exactly the batch inputs the loss reads (old-policy and reference log-probs, the
engine's, advantages and returns), forms micro-batches (dynamic ones the same number on every
data-parallel rank), normalizes the loss by global counts, and reports each step's metrics. It
also owns the step-0 check (`logprob_gap`). The engine only runs micro-batches through its model.
"""

from __future__ import annotations

import logging
from typing import Any, get_args

import torch
from torch import Tensor

from miles.backends.training_utils.algorithms.algorithm import (
    Algorithm,
    compute_advantages_and_returns,
)
from miles.backends.training_utils.algorithms.distillation import DistillationConfig
from miles.backends.training_utils.algorithms.loss import LossNormalizer, reduce_loss
from miles.backends.training_utils.algorithms.loss_config import LossConfig
from miles.backends.training_utils.algorithms.registry import BatchInput
from miles.backends.training_utils.algorithms.teacher_kl import (
    kl_loss_per_token,
    penalize_advantages,
    reverse_kl,
    topk_forward_kl,
)
from miles.backends.training_utils.batching.rollout_data import (
    RolloutBatch,
    batch_size,
    select_rows,
)
from miles.backends.training_utils.batching.train_batches import (
    token_columns,
    token_rows,
)
from miles.backends.training_utils.infra.metrics import (
    log_train_step,
    token_weighted,
)
from miles.backends.training_utils.step.critic import CriticTrainer
from miles.backends.training_utils.step.micro_batches import MicroBatcher
from miles.backends.training_utils.step.optimizer_step import (
    all_reduce_over_replicas,
    loss_normalizer,
    loss_pair,
    take_optimizer_step,
)
from miles.backends.training_utils.step.train_engine import SCORED_TOKEN_IDS, TrainEngine

logger = logging.getLogger(__name__)


class PolicyTrainer:
    """The per-rollout train step over one engine; every rank makes the same calls."""

    def __init__(
        self,
        engine: TrainEngine,
        loss: LossConfig,
        *,
        global_batch_size: int,
        micro_batch_size: int | None,
        max_tokens_per_gpu: int | None,
        use_rollout_logprobs: bool = False,
        distillation: DistillationConfig | None = None,
        critic: TrainEngine | None = None,
        critic_on_own_ranks: bool = False,
    ) -> None:
        """`micro_batch_size` and `max_tokens_per_gpu`: exactly one is set (fixed micro-batches
        of that many samples, or dynamic ones of at most that many tokens per GPU).
        `distillation`: with --use-opd, the teacher KL enters the advantages or the loss.
        `critic`: the value model's engine, for an estimator that reads values (ppo);
        `critic_on_own_ranks` instead: the batch comes with the values of a critic on ranks of
        its own, which trains on the returns this step leaves in the batch."""
        self._micro_batches = MicroBatcher(engine, micro_batch_size, max_tokens_per_gpu)
        self.check_settings(loss, use_rollout_logprobs=use_rollout_logprobs)
        if global_batch_size % engine.dp_size:
            raise ValueError(
                f"--global-batch-size ({global_batch_size}) must be divisible by the "
                f"data-parallel size ({engine.dp_size}); use a multiple of {engine.dp_size}"
            )
        self.engine = engine
        self.config = loss
        self.algorithm = Algorithm.from_config(loss)
        self.distillation = distillation if distillation and distillation.use_opd else None
        # The teacher KL compares the teacher with the policy that sampled (the old policy).
        self.inputs = self.algorithm.inputs | ({"old_log_probs"} if self.distillation else set())
        self.global_batch_size = global_batch_size
        self.use_rollout_logprobs = use_rollout_logprobs
        self.global_step = 0
        """Optimizer steps taken so far (restored on resume)."""
        if critic is not None and critic_on_own_ranks:
            raise ValueError("a critic engine on these ranks and critic_on_own_ranks: pick one")
        has_critic = critic is not None or critic_on_own_ranks
        if ("values" in self.inputs) != has_critic:
            raise ValueError(
                f"--advantage-estimator {loss.advantage_estimator} "
                + ("reads a critic's values, but no critic was given"
                   if not has_critic else "reads no values, but a critic was given")
            )  # fmt: skip
        self.critic = (
            CriticTrainer(critic, loss, global_batch_size=global_batch_size,
                          micro_batches=self._micro_batches)
            if critic is not None
            else None
        )  # fmt: skip

    @staticmethod
    def check_settings(loss: LossConfig, *, use_rollout_logprobs: bool) -> None:
        """Refuse setting combinations the step cannot honour (callable before any model is
        built, as the train actor does)."""
        if use_rollout_logprobs and loss.off_policy_correction is not None:
            raise ValueError(
                f"--off-policy-correction {loss.off_policy_correction} with "
                "--use-rollout-logprobs compares the rollout log-probs with themselves (every "
                "weight is 1); drop one of them"
            )
        if use_rollout_logprobs and "old_log_probs" not in Algorithm.from_config(loss).inputs:
            raise ValueError(
                f"--use-rollout-logprobs has no effect with --loss-type {loss.loss_type}, which "
                "reads no old-policy log-probs; drop the flag"
            )

    # -- the rollout --------------------------------------------------------------------------

    def train(self, batch: RolloutBatch, *, train_policy: bool = True) -> list[dict[str, float]]:
        """Take this rollout's optimizer steps on this rank's shard; each step's metrics. With a
        critic, its steps follow the policy's, their metrics beside the policy's; without
        `train_policy` (--num-critic-only-steps) only the critic trains."""
        num_steps = self._num_steps(batch_size(batch))
        # With one optimizer step the old policy *is* the policy when the step starts: its
        # log-probs come from the step's own forward (detached), not from a second pass. A KL
        # penalty folded into rewards needs them before the step, for the advantages.
        # The same holds for the teacher KL folded into the advantages.
        old_from_step = (
            num_steps == 1
            and not self.use_rollout_logprobs
            and not self.config.kl_coef
            and not (self.distillation and self.distillation.kl_in_advantages)
        )
        self._prepare(batch, old_from_step=old_from_step)
        per_step = batch_size(batch) // num_steps
        metrics: list[dict[str, float]] = [{} for _ in range(num_steps)]
        for step in range(num_steps if train_policy else 0):
            rows = range(step * per_step, (step + 1) * per_step)
            metrics[step] = self._step(select_rows(batch, rows), old_from_step=old_from_step)
            logger.info("step %d/%d: %s", step + 1, num_steps, metrics[step])
        if self.critic is not None:
            for step, critic_metrics in enumerate(self.critic.train(batch)):
                metrics[step].update(critic_metrics)
        return metrics

    def logprob_gap(self, batch: RolloutBatch) -> float:
        """The step-0 check: mean |trainer - engine| log-prob over the trainable (loss-mask 1)
        response tokens of every rank's shard."""
        if "rollout_log_probs" not in batch:
            raise ValueError(
                "the step-0 check compares with the engine's log-probs, but the batch has none; "
                "request return_logprob in the rollout or pass --check-weight-sync-tolerance none"
            )
        ours = self.log_probs(batch, reference=False)
        totals = torch.zeros(2, dtype=torch.float64)  # [sum |gap| * mask, sum mask]
        for trainer, engine, mask in zip(
            ours, batch["rollout_log_probs"], batch["loss_mask"], strict=True
        ):
            weights = torch.as_tensor(mask, dtype=torch.float64)
            gap = (trainer.double() - torch.as_tensor(engine, dtype=torch.float64)).abs()
            totals += torch.stack([(gap * weights).sum(), weights.sum()])
        gap_sum, tokens = self._all_reduce(totals).tolist()
        return gap_sum / max(tokens, 1.0)

    def _num_steps(self, local_samples: int) -> int:
        dp, gbs = self.engine.dp_size, self.global_batch_size
        total = local_samples * dp
        if local_samples == 0 or total % gbs:
            raise ValueError(
                f"the rollout holds {total} samples ({local_samples} per data-parallel rank x "
                f"{dp} ranks), not a positive multiple of --global-batch-size ({gbs}); make "
                "--rollout-batch-size x --n-samples-per-prompt a multiple of it"
            )
        return total // gbs

    def _prepare(self, batch: RolloutBatch, *, old_from_step: bool) -> None:
        """The batch inputs needed before the first step, for the whole shard."""
        inputs = self.inputs
        if self.critic is not None:
            batch["values"] = self.critic.values(batch)
        elif "values" in inputs and "values" not in batch:
            raise ValueError(
                f"--advantage-estimator {self.config.advantage_estimator} reads a critic's "
                "values, but the batch has none: the critic on ranks of its own gives them "
                "(TrainRayActor.critic_values) before the policy's step"
            )
        if "rollout_log_probs" in inputs or self.use_rollout_logprobs:
            _require_rollout_log_probs(batch, self.use_rollout_logprobs)
        if "old_log_probs" in inputs and not old_from_step:
            if self.use_rollout_logprobs:
                batch["old_log_probs"] = [torch.as_tensor(r) for r in batch["rollout_log_probs"]]
            else:
                batch["old_log_probs"] = self.log_probs(batch, reference=False)
        if "ref_log_probs" in inputs:
            batch["ref_log_probs"] = self.log_probs(batch, reference=True)
        if self.distillation is not None and "teacher_log_probs" not in batch:
            raise ValueError(
                "--use-opd trains on the teacher's log-probs, but the batch has no "
                "'teacher_log_probs': the rollout manager scores every sample with the teacher "
                "engines; a custom path that builds train data must keep Sample.teacher_log_probs"
            )
        if self.distillation is not None and self.distillation.teacher_top_k:
            missing = {SCORED_TOKEN_IDS, "teacher_top_log_probs"} - batch.keys()
            if missing:
                raise ValueError(
                    f"--opd-kl-mode topk trains on the teacher's top tokens, but the batch has no "
                    f"{sorted(missing)}: the rollout manager asks the teacher engines for them; a "
                    "custom path that builds train data must keep Sample.teacher_top_ids and "
                    "teacher_top_log_probs"
                )
        if "advantages" in inputs:
            compute_advantages_and_returns(batch, self.config, group=self.engine.dp_group)
            if self.distillation is not None and self.distillation.kl_in_advantages:
                batch["advantages"] = penalize_advantages(
                    batch["advantages"],
                    [torch.as_tensor(lp) for lp in batch["old_log_probs"]],
                    [torch.as_tensor(lp) for lp in batch["teacher_log_probs"]],
                    [torch.as_tensor(m) for m in batch["loss_mask"]],
                    coef=self.distillation.opd_kl_coef,
                )

    # -- one optimizer step -------------------------------------------------------------------

    def _step(self, step_batch: RolloutBatch, *, old_from_step: bool) -> dict[str, float]:
        """One optimizer step over this rank's share of one global batch."""
        normalizer = loss_normalizer(self.engine, step_batch, self.global_batch_size)
        micro_batches = list(self._micro_batches(step_batch))
        # Each batch input the loss reads is the shard column of the same name.
        loss_columns = [
            name
            for name in get_args(BatchInput)
            if name in self.inputs and not (old_from_step and name == "old_log_probs")
        ]
        teacher_columns = ["teacher_log_probs"] if self.distillation is not None else []
        compute_loss, config = self.algorithm.loss.loss_function, self.config

        def loss_fn(index: int, log_probs: Tensor, entropy: Tensor, scored: Tensor | None):
            micro = micro_batches[index]
            tensors = token_columns(micro, ["loss_mask", *loss_columns, *teacher_columns])
            inputs: dict[str, Any] = {
                "log_probs": log_probs,
                "entropy": entropy,
                "loss_mask": tensors["loss_mask"].to(log_probs.device),
                "response_lengths": micro["response_lengths"],
            }
            for name in loss_columns:
                inputs[name] = tensors[name].to(log_probs.device)
            if old_from_step and "old_log_probs" in self.inputs:
                inputs["old_log_probs"] = log_probs.detach()  # ratio 1: the step's start policy
            loss, metrics = compute_loss(inputs, config, normalizer)
            if self.distillation is not None:
                teacher = tensors["teacher_log_probs"].to(log_probs.device)
                loss = loss + self._teacher_kl_term(inputs, teacher, normalizer, metrics)
            if self.distillation is not None and self.distillation.teacher_top_k:
                loss = loss + self._topk_term(inputs, micro, scored, normalizer, metrics)
            metrics["loss"] = loss_pair(loss, len(micro_batches))
            return loss, metrics

        metrics, result = take_optimizer_step(self.engine, micro_batches, loss_fn, "optimizer")
        self.global_step += 1
        return log_train_step(
            metrics, step=self.global_step, lr=result.lr, grad_norm=result.grad_norm
        )

    def _teacher_kl_term(
        self, inputs: dict[str, Any], teacher: Tensor, normalizer: LossNormalizer, metrics: dict
    ) -> Tensor:
        """Reports `opd_teacher_kl` (mean per trainable token); returns the loss-mode term (0 in
        advantages mode, where the KL already is in the advantages)."""
        assert self.distillation is not None
        mask, old = inputs["loss_mask"], inputs["old_log_probs"]
        metrics["opd_teacher_kl"] = token_weighted(reverse_kl(old, teacher), mask)
        if not self.distillation.kl_in_loss:
            return torch.zeros((), dtype=inputs["log_probs"].dtype, device=mask.device)
        per_token = kl_loss_per_token(inputs["log_probs"], old, teacher)  # (T,)
        term = reduce_loss(
            per_token, mask.to(per_token.dtype), list(inputs["response_lengths"]),
            config=self.config, normalizer=normalizer,
        )  # fmt: skip
        return self.distillation.opd_kl_coef * term

    def _topk_term(
        self,
        inputs: dict[str, Any],
        micro: RolloutBatch,
        scored: Tensor | None,
        normalizer: LossNormalizer,
        metrics: dict,
    ) -> Tensor:
        """The topk-mode loss term, coef x the reduced forward KL from the teacher's top tokens;
        reports it per trainable token as `opd_topk_kl`."""
        assert self.distillation is not None
        if scored is None:
            raise RuntimeError(
                f"--opd-kl-mode topk needs the log-probs of the micro-batch's {SCORED_TOKEN_IDS} "
                "from the train engine, which passed none (a backend bug)"
            )
        mask = inputs["loss_mask"]
        teacher = token_rows(micro, "teacher_top_log_probs", torch.float32).to(scored.device)
        per_token = topk_forward_kl(scored, teacher)  # (T,)
        metrics["opd_topk_kl"] = token_weighted(per_token.detach(), mask)
        term = reduce_loss(
            per_token, mask.to(per_token.dtype), list(inputs["response_lengths"]),
            config=self.config, normalizer=normalizer,
        )  # fmt: skip
        return self.distillation.opd_kl_coef * term

    # -- micro-batches and collectives --------------------------------------------------------

    def log_probs(self, batch: RolloutBatch, *, reference: bool = False) -> list[Tensor]:
        """Per-sample (R,) log-probs of the policy (or reference) over the shard, no gradients."""
        iterator = self._micro_batches(batch)
        micro_batches = list(iterator)
        return iterator.per_sample(
            self.engine.forward_log_probs(micro_batches, reference=reference)
        )

    def _all_reduce(self, values: Tensor, op: Any = None) -> Tensor:
        """`values` (float64, CPU) reduced over the data-parallel replicas (SUM by default)."""
        return all_reduce_over_replicas(self.engine, values, op)


def _require_rollout_log_probs(batch: RolloutBatch, use_rollout_logprobs: bool) -> None:
    if "rollout_log_probs" not in batch:
        why = (
            "--use-rollout-logprobs takes the old policy's log-probs from the engine"
            if use_rollout_logprobs
            else "--off-policy-correction weighs by the engine's log-probs"
        )
        raise ValueError(
            f"{why}, but the batch has no 'rollout_log_probs'; request return_logprob in the "
            "rollout"
        )
