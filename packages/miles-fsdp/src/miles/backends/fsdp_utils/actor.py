"""`FSDPTrainRayActor`: one rank of the FSDP2 training backend (the contract of DESIGN §3.1).

Rank 0 alone reads the Hugging Face checkpoint; the other ranks build the model on the meta device
and receive their shards from rank 0. Micro-batches are packed; sdpa and eager run their documents
as the rows of a right-padded batch, flash attention runs the packed row with restarting position
ids, so no token ever attends across documents. Not supported: critic, LoRA, context
parallelism (FSDPArgs or `init` refuses each, naming its flag).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils import checkpoint
from miles.backends.fsdp_utils.arguments import FSDPArgs
from miles.backends.fsdp_utils.lr_scheduler import get_lr_scheduler
from miles.backends.fsdp_utils.modeling import build_fsdp_model, packed_logits, response_positions
from miles.backends.fsdp_utils.parallel import build_fsdp_meshes, create_fsdp_parallel_state
from miles.backends.fsdp_utils.precision import PrecisionPolicy
from miles.backends.fsdp_utils.update_weight_utils import iter_full_tensors
from miles.backends.sglang_utils.weight_sync import WeightUpdater, make_weight_updater
from miles.backends.training_utils.advantages import compute_advantages_and_returns
from miles.backends.training_utils.data import get_batch, get_data_iterator
from miles.backends.training_utils.device import (
    dist_backend,
    empty_cache,
    get_device_info,
    set_device,
    synchronize,
)
from miles.backends.training_utils.log_utils import aggregate_train_losses, log_train_step
from miles.backends.training_utils.logprobs import get_log_probs_and_entropy
from miles.backends.training_utils.loss import LossNormalizer, loss_function
from miles.backends.training_utils.micro_batch import num_micro_batches
from miles.backends.training_utils.packing import PackedBatch
from miles.backends.training_utils.rollout_data import RolloutBatch, batch_size, select_rows
from miles.ray import TrainRayActor

logger = logging.getLogger(__name__)


def check_supported(args: Any, role: str) -> None:
    """Refuse, naming the flag, what this backend would otherwise ignore (DESIGN §8).

    FSDPArgs refuses its own unsupported settings (LoRA, context parallelism, a critic, flash
    attention without a GPU) where it is built; these need the role, the loss or the device.
    """
    fsdp, loss = args.fsdp, args.loss
    if role != "actor" or loss.advantage_estimator == "ppo":
        raise ValueError(
            f"the FSDP backend trains the policy only (role 'actor'), got role {role!r} with "
            f"--advantage-estimator {loss.advantage_estimator}; a critic (--use-critic, needed "
            "by ppo) is not supported by the FSDP backend: use the megatron backend or a "
            "critic-free estimator such as grpo"
        )
    if fsdp.fsdp_cpu_offload and not get_device_info().is_accelerator:
        raise ValueError(
            "--fsdp-cpu-offload has no effect on CPU: parameters already live in host memory; "
            "drop the flag"
        )
    if fsdp.use_rollout_logprobs and loss.off_policy_correction is not None:
        raise ValueError(
            f"--off-policy-correction {loss.off_policy_correction} with --use-rollout-logprobs "
            "compares the rollout log-probs with themselves (every weight is 1); drop one of them"
        )


# -- model loading ---------------------------------------------------------------------------


def _total_steps(args: Any) -> int | None:
    """Optimizer steps of the whole run, when the run's length is known (the default for
    --lr-decay-iters); None leaves a decaying schedule to ask for --lr-decay-iters."""
    num_rollout = getattr(args, "num_rollout", None)
    rollout_batch_size = getattr(args, "rollout_batch_size", None)
    if not num_rollout or not rollout_batch_size:
        return None
    samples = rollout_batch_size * args.n_samples_per_prompt
    return num_rollout * samples // args.global_batch_size


def _resolve(data_ref: Any) -> RolloutBatch:
    # Ray hands an actor method the value behind a top-level ObjectRef argument, so a rank's
    # shard arrives here as the RolloutBatch itself.
    if isinstance(data_ref, dict):
        return data_ref
    raise TypeError(
        f"train() got data of type {type(data_ref).__name__}; pass this rank's RolloutBatch "
        "(a dict of per-sample lists), or its ray.ObjectRef as a top-level argument"
    )


class FSDPTrainRayActor(TrainRayActor):
    """One rank of the FSDP2 policy trainer; every rank gets the same calls in the same order."""

    config_class = FSDPArgs
    """The backend's settings group: `miles train --train-backend fsdp` adds these flags."""

    export_checkpoint = staticmethod(checkpoint.export_checkpoint_to_hf)
    """`miles export-hf`: a saved checkpoint as a Hugging Face directory, offline."""

    # -- set-up ------------------------------------------------------------------------------

    def init(self, args: Any, role: str, with_ref: bool) -> int:
        check_supported(args, role)
        # The device first: NCCL binds a communicator to the device current at its creation.
        self.device = set_device(self.local_rank)
        self.setup_distributed()
        self.args, fsdp = args, args.fsdp
        torch.manual_seed(fsdp.seed)
        meshes = build_fsdp_meshes(
            self.device.type, self.world_size, fsdp.context_parallel_size, fsdp.dp_replicate_size
        )
        self.parallel = create_fsdp_parallel_state(meshes)
        self.dp = self.parallel.dp
        if args.global_batch_size % self.dp.size:
            raise ValueError(
                f"--global-batch-size ({args.global_batch_size}) must be divisible by the "
                f"data-parallel size ({self.dp.size}); use a multiple of {self.dp.size}"
            )
        self.precision = PrecisionPolicy.from_args(fsdp, get_device_info().kind)
        self.model = self._build_model(meshes["fsdp"], trainable=True)
        needs_ref = args.loss.use_kl_loss or bool(args.loss.kl_coef)
        self.ref_model = (
            self._build_model(meshes["fsdp"], trainable=False) if with_ref or needs_ref else None
        )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=fsdp.lr,
            betas=(fsdp.adam_beta1, fsdp.adam_beta2),
            eps=fsdp.adam_eps,
            weight_decay=fsdp.weight_decay,
        )
        self.lr_scheduler = get_lr_scheduler(
            self.optimizer,
            decay_style=fsdp.lr_decay_style,
            lr=fsdp.lr,
            min_lr=fsdp.min_lr,
            warmup_iters=fsdp.lr_warmup_iters,
            decay_iters=fsdp.lr_decay_iters or _total_steps(args),
            wsd_decay_iters=fsdp.lr_wsd_decay_iters,
        )
        self.weight_version = 0
        self.global_step = 0
        self._updater: WeightUpdater | None = None
        self._asleep = False
        self._old_is_current = False  # set per rollout by _prepare
        return self._resume()

    def _build_model(self, mesh: DeviceMesh, *, trainable: bool) -> nn.Module:
        fsdp = self.args.fsdp
        # The frozen reference model only runs forward passes: on accelerators its shards wait
        # in host memory and visit the device per layer.
        offload = fsdp.fsdp_cpu_offload if trainable else get_device_info().is_accelerator
        return build_fsdp_model(
            self.args.hf_checkpoint,
            mesh=mesh,
            device=self.device,
            precision=self.precision,
            attn_implementation=fsdp.attn_implementation,
            cpu_offload=offload,
            gradient_checkpointing=fsdp.gradient_checkpointing,
            trainable=trainable,
        )

    def _resume(self) -> int:
        """The rollout id to start from: after the checkpoint in --load, else 0."""
        if not self.args.load:
            return 0
        meta = checkpoint.load_checkpoint(
            self.args.load,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
        )
        if meta is None:
            logger.info("no checkpoint in --load %s; starting at rollout 0", self.args.load)
            return 0
        extra = meta.get("extra", {})
        self.weight_version = int(extra.get("weight_version", 0))
        self.global_step = int(extra.get("global_step", 0))
        logger.info("resumed rollout %s from %s", meta["rollout_id"], self.args.load)
        return int(meta["rollout_id"]) + 1

    # -- training ----------------------------------------------------------------------------

    def train(self, rollout_id: int, data_ref: Any) -> list[dict[str, float]]:
        """Take this rollout's optimizer steps; returns each step's metrics (same on all ranks)."""
        if self._asleep:
            raise RuntimeError("train() while asleep: call wake_up() first")
        batch = _resolve(data_ref)
        n = batch_size(batch)
        num_steps = self._num_steps(n)
        self._prepare(batch, num_steps)
        per_step = n // num_steps
        metrics = []
        for step in range(num_steps):
            rows = range(step * per_step, (step + 1) * per_step)
            metrics.append(self._train_step(select_rows(batch, rows)))
            logger.info("rollout %d step %d/%d: %s", rollout_id, step + 1, num_steps, metrics[-1])
        return metrics

    def logprob_gap(self, data_ref: Any) -> float:
        """Mean |trainer - engine| log-prob per response token of this batch, over all ranks."""
        batch = _resolve(data_ref)
        if "rollout_log_probs" not in batch:
            raise ValueError(
                "the step-0 check compares with the engine's log-probs, but the batch has none; "
                "request return_logprob in the rollout or pass --check-weight-sync-tolerance none"
            )
        trainer = self._forward_log_probs(self.model, batch)
        gap, tokens = 0.0, 0.0
        for ours, theirs, mask in zip(
            trainer, batch["rollout_log_probs"], batch["loss_masks"], strict=True
        ):
            weights = torch.as_tensor(mask, dtype=torch.float64)
            diff = (ours.double().cpu() - torch.as_tensor(theirs, dtype=torch.float64)).abs()
            gap += float((diff * weights).sum())
            tokens += float(weights.sum())
        gap = self._all_reduce(gap, dist.ReduceOp.SUM)
        tokens = self._all_reduce(tokens, dist.ReduceOp.SUM)
        return gap / max(tokens, 1.0)

    def _num_steps(self, local_samples: int) -> int:
        total, gbs = local_samples * self.dp.size, self.args.global_batch_size
        if local_samples == 0 or total % gbs:
            raise ValueError(
                f"the rollout holds {total} samples ({local_samples} per data-parallel rank x "
                f"{self.dp.size} ranks), not a positive multiple of --global-batch-size ({gbs}); "
                "make --rollout-batch-size x --n-samples-per-prompt a multiple of it"
            )
        return total // gbs

    def _prepare(self, batch: RolloutBatch, num_steps: int) -> None:
        """Old-policy and reference log-probs, then advantages, for the whole local batch.

        With one optimizer step per rollout the old policy *is* the current one when the step
        starts, so its log-probs are taken from the step's own forward (detached) instead of a
        second forward pass over the batch; a reward KL still needs them up front.
        """
        loss = self.args.loss
        self._old_is_current = (
            num_steps == 1 and not self.args.fsdp.use_rollout_logprobs and not loss.kl_coef
        )
        if loss.loss_type != "sft_loss" and not self._old_is_current:
            if self.args.fsdp.use_rollout_logprobs:
                if "rollout_log_probs" not in batch:
                    raise ValueError(
                        "--use-rollout-logprobs needs the engine's log-probs, but the batch has "
                        "no 'rollout_log_probs'; request return_logprob in rollout"
                    )
                batch["log_probs"] = [torch.as_tensor(r) for r in batch["rollout_log_probs"]]
            else:
                batch["log_probs"] = self._forward_log_probs(self.model, batch)
        if self.ref_model is not None:
            batch["ref_log_probs"] = self._forward_log_probs(self.ref_model, batch)
        if loss.loss_type != "sft_loss":
            compute_advantages_and_returns(batch, loss, group=self.dp.group)

    def _micro_batches(self, batch: RolloutBatch):
        """Micro-batches of `batch`; dynamic ones come in the same number on every dp rank,
        because each forward and backward is a collective over the FSDP mesh."""
        fsdp = self.args.fsdp
        if not fsdp.use_dynamic_batch_size:
            return get_data_iterator(
                batch,
                micro_batch_size=fsdp.micro_batch_size,
                max_tokens_per_gpu=None,
                use_dynamic_batch_size=False,
            )
        count = num_micro_batches(batch["total_lengths"], fsdp.max_tokens_per_gpu)
        count = int(self._all_reduce(float(count), dist.ReduceOp.MAX))
        return get_data_iterator(
            batch,
            micro_batch_size=None,
            max_tokens_per_gpu=fsdp.max_tokens_per_gpu,
            use_dynamic_batch_size=True,
            num_micro_batches=count,
        )

    def _log_probs(
        self, model: nn.Module, packed: PackedBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum R,) log-probs and entropies of a micro-batch's response tokens."""
        logits = packed_logits(
            model,
            packed,
            attn_implementation=self.args.fsdp.attn_implementation,
            device=self.device,
        )  # (T, V)
        positions = response_positions(packed).to(self.device)  # (sum R,)
        targets = packed.input_ids[0].to(self.device)[positions + 1]  # (sum R,)
        return get_log_probs_and_entropy(
            logits[positions], targets, temperature=self.args.rollout_temperature
        )

    def _forward_log_probs(self, model: nn.Module, batch: RolloutBatch) -> list[torch.Tensor]:
        """Per-sample (R,) log-probs of `model` over the whole local batch, without gradients."""
        was_training = model.training
        model.eval()
        out: list[torch.Tensor | None] = [None] * batch_size(batch)
        micro_batches = self._micro_batches(batch)
        with torch.no_grad():
            for indices, micro in zip(micro_batches.micro_batches, micro_batches, strict=True):
                log_probs, _ = self._log_probs(model, get_batch(micro, ())["packed"])
                for row, piece in zip(
                    indices, log_probs.split(micro["response_lengths"]), strict=True
                ):
                    out[row] = piece.float().cpu()
        model.train(was_training)
        return out  # type: ignore[return-value]

    def _loss_keys(self) -> tuple[str, ...]:
        loss = self.args.loss
        if loss.loss_type == "sft_loss":
            return ("loss_masks",)
        keys = ["loss_masks", "advantages"]
        if not self._old_is_current:
            keys.insert(1, "log_probs")  # the old policy's, computed in _prepare
        if loss.use_kl_loss:
            keys.append("ref_log_probs")
        if loss.off_policy_correction is not None:
            keys.append("rollout_log_probs")
        return tuple(keys)

    def _train_step(self, step_batch: RolloutBatch) -> dict[str, float]:
        """One optimizer step over this rank's share of one global batch."""
        local_tokens = float(sum(sum(mask) for mask in step_batch["loss_masks"]))
        normalizer = LossNormalizer(
            num_samples=self.args.global_batch_size,
            num_tokens=int(self._all_reduce(local_tokens, dist.ReduceOp.SUM)),
            dp_size=self.dp.size,
        )
        self.model.train()
        pairs, loss_sum = [], torch.zeros((), dtype=torch.float64)
        for micro in self._micro_batches(step_batch):
            tensors = get_batch(micro, self._loss_keys())
            log_probs, entropy = self._log_probs(self.model, tensors["packed"])
            inputs = {
                "log_probs": log_probs,
                "entropy": entropy,
                "loss_mask": tensors["loss_masks"].to(self.device),
                "response_lengths": micro["response_lengths"],
            }
            for key in self._loss_keys()[1:]:
                inputs["old_log_probs" if key == "log_probs" else key] = tensors[key].to(
                    self.device
                )
            if self._old_is_current and self.args.loss.loss_type != "sft_loss":
                inputs["old_log_probs"] = log_probs.detach()  # ratio 1: the step's start policy
            loss, metrics = loss_function(inputs, self.args.loss, normalizer)
            loss.backward()
            pairs.append(metrics)
            # Undo the dp scaling: summed over ranks this is the global batch's loss.
            loss_sum += loss.detach().cpu().double() / self.dp.size
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm = self._clip_and_step()
        metrics = aggregate_train_losses(pairs, group=self.dp.group)
        metrics["loss"] = self._all_reduce(float(loss_sum), dist.ReduceOp.SUM)
        self.global_step += 1
        return log_train_step(metrics, step=self.global_step, lr=lr, grad_norm=grad_norm)

    def _clip_and_step(self) -> float:
        """Clip by the norm of the full gradient (over every shard), then step; returns the norm."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if isinstance(total, DTensor):
            total = total.full_tensor()  # the local norms are partial: reduce them over the mesh
        grad_norm = float(total)
        if not math.isfinite(grad_norm):
            # Every rank sees the same full norm, so every rank skips together.
            logger.warning("grad norm %s is not finite: skipping optimizer step", grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm
        if self.args.fsdp.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.args.fsdp.clip_grad, total)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _all_reduce(self, value: float, op: dist.ReduceOp) -> float:
        """Reduce one number over the data-parallel ranks (a no-op without dp)."""
        if self.dp.group is None:
            return value
        device = torch.device("cpu") if dist_backend() == "gloo" else self.device
        tensor = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=op, group=self.dp.group)
        return float(tensor.item())

    # -- checkpoints, weights, memory ------------------------------------------------------------

    def save_model(self, rollout_id: int) -> None:
        if not self.args.save:
            raise ValueError("save_model() needs a checkpoint directory: set --save")
        checkpoint.save_checkpoint(
            self.args.save,
            rollout_id,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            extra_meta={
                "weight_version": self.weight_version,
                "global_step": self.global_step,
                "hf_checkpoint": str(self.args.hf_checkpoint),
            },
        )

    def export_hf(self, path: str | Path) -> None:
        checkpoint.export_hf(
            self.model,
            path,
            config=self.model.config,
            tokenizer_path=self.args.hf_checkpoint,
            dtype=self.precision.engine_dtype,
        )

    def update_weights(self) -> None:
        """Push the weights to every engine as the next weight version (all ranks call this)."""
        if not self.args.engine_urls:
            raise ValueError(
                "update_weights() has no engine to update: --engine-urls is empty; pass the "
                "rollout engines' URLs"
            )
        if self._updater is None:
            self._updater = self._make_updater()
        self.weight_version += 1
        self._updater.update(str(self.weight_version))

    def _make_updater(self) -> WeightUpdater:
        dtype = self.precision.engine_dtype
        return make_weight_updater(
            lambda: iter_full_tensors(self.model, dtype), engine_urls=self.args.engine_urls,
            rank=self.rank, world_size=self.world_size, colocate=self.args.colocate,
            buffer_size=self.args.fsdp.update_weight_buffer_size, dtype=dtype,
            master_address=self.master_addr, group_name="miles-fsdp-weights",
        )  # fmt: skip

    def sleep(self) -> None:
        """Move parameters, gradients and optimizer state to host memory, freeing the device.

        On CPU there is no separate device memory to free: the state stays where it is.
        """
        self._move_to(torch.device("cpu"))
        self._asleep = True

    def wake_up(self) -> None:
        """Bring the state moved by `sleep` back onto this rank's device."""
        self._move_to(self.device)
        self._asleep = False

    def _move_to(self, device: torch.device) -> None:
        if not get_device_info().is_accelerator:
            logger.info("rank %d: on CPU, sleep/wake_up keep the state in place", self.rank)
            return
        # With --fsdp-cpu-offload FSDP already keeps shards, gradients and optimizer state on the
        # host; the frozen reference model is always offloaded on accelerators.
        if not self.args.fsdp.fsdp_cpu_offload:
            self.model.to(device)  # moves gradients along with their parameters
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        state[key] = value.to(device, non_blocking=True)
        synchronize()
        empty_cache()

    def close(self) -> None:
        """Leave the engines' weight-update group (disaggregated) and close engine clients."""
        if self._updater is not None:
            self._updater.shutdown()
            self._updater = None
