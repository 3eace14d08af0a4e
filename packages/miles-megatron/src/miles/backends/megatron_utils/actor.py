"""`MegatronTrainRayActor`: one rank of the Megatron-core training backend (DESIGN §3.1).

Megatron's parallel state splits the ranks into tensor, pipeline, context and expert groups; the
model is a GPTModel built from the Hugging Face config (Qwen2, Qwen3, Llama) and loaded from the HF
weights; the optimizer is Megatron's (distributed by default). Losses, advantages and their
normalization are training-utils', exactly as in the FSDP backend. GPU-only: `init` refuses a
machine without NVIDIA or AMD GPUs. Not supported yet (refused at `init`, naming the flag): a
critic.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from transformers import AutoConfig, AutoModelForCausalLM

from miles.backends.megatron_utils import checkpoint
from miles.backends.megatron_utils.arguments import MegatronArgs, validate_against_hf
from miles.backends.megatron_utils.forward import MicroBatchForward
from miles.backends.megatron_utils.model_provider import (
    build_gpt_model,
    load_hf_weights,
    require_gpu,
    transformer_config_from_hf,
)
from miles.backends.megatron_utils.offload import StorageOffloader
from miles.backends.megatron_utils.parallel import initialize_megatron_parallel
from miles.backends.megatron_utils.weights import export_hf_directory, iter_hf_tensors
from miles.backends.sglang_utils.weight_sync import WeightUpdater, make_weight_updater
from miles.backends.training_utils.advantages import compute_advantages_and_returns
from miles.backends.training_utils.data import get_data_iterator
from miles.backends.training_utils.device import set_device
from miles.backends.training_utils.rollout_data import RolloutBatch, batch_size, select_rows
from miles.ray import TrainRayActor

logger = logging.getLogger(__name__)


class MegatronTrainRayActor(TrainRayActor):
    """One rank of the Megatron policy trainer; every rank gets the same calls in the same order."""

    config_class = MegatronArgs
    """The backend's settings group: `miles train --train-backend megatron` adds these flags."""

    # -- set-up ------------------------------------------------------------------------------

    def init(self, args: Any, role: str, with_ref: bool) -> int:
        require_gpu()
        mg: MegatronArgs = args.megatron
        if role != "actor" or args.loss.advantage_estimator == "ppo":
            raise ValueError(
                f"the megatron backend trains the policy only (role 'actor'), got {role!r} with "
                f"--advantage-estimator {args.loss.advantage_estimator}; use a critic-free "
                "estimator such as grpo"
            )
        self.args, self.mg = args, mg
        self.device = set_device(self.local_rank)
        self.setup_distributed()
        self.hf_config = AutoConfig.from_pretrained(args.hf_checkpoint)
        validate_against_hf(mg, self.hf_config, self.world_size)
        initialize_megatron_parallel(mg)  # groups, the seeded RNG tracker, training-utils' state
        torch.manual_seed(mg.seed)
        self.transformer_config = transformer_config_from_hf(self.hf_config, mg)
        # Megatron's schedules call this after the backward: data-parallel gradient averaging and
        # the tensor-parallel sums of replicated parameters (e.g. Qwen3's q/k norms).
        self.transformer_config.finalize_model_grads_func = finalize_model_grads
        self.model = self._build_model()
        self.ref_model = None
        if with_ref or args.loss.use_kl_loss or args.loss.kl_coef:
            self.ref_model = self._build_model(trainable=False)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=mg.lr,
                min_lr=mg.min_lr,
                weight_decay=mg.weight_decay,
                adam_beta1=mg.adam_beta1,
                adam_beta2=mg.adam_beta2,
                adam_eps=mg.adam_eps,
                clip_grad=mg.clip_grad,
                bf16=mg.params_dtype == "bfloat16",
                params_dtype=getattr(torch, mg.params_dtype),
                use_distributed_optimizer=mg.use_distributed_optimizer,
            ),
            [self.model],
        )
        total = _total_steps(args)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if mg.lr_warmup_iters else mg.lr,
            max_lr=mg.lr,
            min_lr=mg.min_lr,
            lr_warmup_steps=mg.lr_warmup_iters,
            lr_decay_steps=mg.lr_decay_iters or total or 1,
            lr_decay_style=mg.lr_decay_style,
            start_wd=mg.weight_decay,
            end_wd=mg.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )
        self.forward = MicroBatchForward(
            hf_config=self.hf_config, temperature=args.rollout_temperature, device=self.device,
            cp_group=mpu.get_context_parallel_group(),
        )  # fmt: skip
        self.weight_version, self.global_step = 0, 0
        self._updater: WeightUpdater | None = None
        self._asleep = False
        self._offloader = StorageOffloader(self.device)
        return self._resume()

    def _build_model(self, *, trainable: bool = True) -> torch.nn.Module:
        model = build_gpt_model(
            self.hf_config,
            self.mg,
            pre_process=mpu.is_pipeline_first_stage(),
            post_process=mpu.is_pipeline_last_stage(),
        ).to(self.device)
        # Every rank reads the HF weights and keeps its own tensor-parallel slices of them.
        hf_model = AutoModelForCausalLM.from_pretrained(
            self.args.hf_checkpoint, dtype=torch.float32
        )
        load_hf_weights(model, hf_model.state_dict(), self.hf_config, self.mg)
        del hf_model
        if not trainable:
            model.requires_grad_(False)
            return model.eval()
        return DistributedDataParallel(
            config=self.transformer_config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                use_distributed_optimizer=self.mg.use_distributed_optimizer,
            ),
            module=model,
        )

    def _resume(self) -> int:
        if not self.args.load:
            return 0
        meta = checkpoint.load(self.args.load, self.model, self.optimizer, self.scheduler)
        if meta is None:
            return 0
        self.weight_version = int(meta.get("weight_version", 0))
        self.global_step = int(meta.get("global_step", 0))
        return int(meta["rollout_id"]) + 1

    # -- training ----------------------------------------------------------------------------

    @property
    def dp_size(self) -> int:
        return mpu.get_data_parallel_world_size()

    def data_parallel_rank(self) -> int:
        # Tensor / pipeline / context-parallel peers hold one replica and train on one shard.
        return mpu.get_data_parallel_rank()

    def train(self, rollout_id: int, data_ref: Any) -> list[dict[str, float]]:
        self._require_awake("train")
        batch: RolloutBatch = data_ref
        n = batch_size(batch)
        num_steps = n * self.dp_size // self.args.global_batch_size
        if num_steps < 1 or n * self.dp_size % self.args.global_batch_size:
            raise ValueError(
                f"the rollout holds {n * self.dp_size} samples, not a positive multiple of "
                f"--global-batch-size ({self.args.global_batch_size})"
            )
        self._prepare(batch)
        per_step = n // num_steps
        metrics = []
        for step in range(num_steps):
            rows = range(step * per_step, (step + 1) * per_step)
            metrics.append(self._train_step(select_rows(batch, rows)))
        return metrics

    def _prepare(self, batch: RolloutBatch) -> None:
        loss = self.args.loss
        if loss.loss_type == "sft_loss":
            return
        if self.mg.use_rollout_logprobs:
            batch["log_probs"] = [torch.as_tensor(r) for r in batch["rollout_log_probs"]]
        else:
            batch["log_probs"] = self._forward_log_probs(self.model, batch)
        if self.ref_model is not None:
            batch["ref_log_probs"] = self._forward_log_probs(self.ref_model, batch)
        compute_advantages_and_returns(batch, loss, group=mpu.get_data_parallel_group())

    def _micro_batches(self, batch: RolloutBatch):
        dynamic = self.mg.use_dynamic_batch_size
        # Each context-parallel rank holds 1/cp of every sequence: the per-GPU token budget
        # admits cp times the tokens per micro-batch.
        budget = self.mg.max_tokens_per_gpu
        return get_data_iterator(
            batch,
            micro_batch_size=None if dynamic else self.mg.micro_batch_size,
            max_tokens_per_gpu=budget * self.mg.context_parallel_size if dynamic else budget,
            use_dynamic_batch_size=dynamic,
        )

    def _forward_log_probs(self, model: torch.nn.Module, batch: RolloutBatch) -> list[torch.Tensor]:
        """Per-sample (R,) log-probs without gradients, via Megatron's forward-only schedule."""
        iterator = self._micro_batches(batch)
        rows_per_micro = iterator.micro_batches  # dynamic batching regroups the rows
        # Megatron's forward-only schedule keeps autograd on: without this every activation of
        # the pass would stay alive as in training.
        with torch.no_grad():
            results = self._run_schedule(
                model, list(iterator), forward_only=True, collect="log_probs"
            )
        out: list[torch.Tensor | None] = [None] * batch_size(batch)
        for rows, item in zip(rows_per_micro, results, strict=False):
            for row, log_probs in zip(rows, item["log_probs"], strict=True):
                out[row] = log_probs
        # Only the last stage has logits; the other stages need the values for advantages.
        return _from_last_stage(out)  # type: ignore[return-value]

    def _train_step(self, step_batch: RolloutBatch) -> dict[str, float]:
        micro = list(self._micro_batches(step_batch))
        normalizer = self.forward.normalizer(
            step_batch, global_batch_size=self.args.global_batch_size, dp_size=self.dp_size,
            dp_group=mpu.get_data_parallel_group(),
        )  # fmt: skip
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self._run_schedule(
            self.model, micro, forward_only=False, collect="loss", normalizer=normalizer
        )
        lr = self.optimizer.param_groups[0]["lr"]
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        else:
            logger.warning("rank %d: optimizer step skipped (non-finite gradients)", self.rank)
        self.global_step += 1
        metrics = self.forward.step_metrics(
            losses, group=mpu.get_data_parallel_group(), step=self.global_step, lr=lr,
            grad_norm=float(grad_norm or 0.0),
        )  # fmt: skip
        return _from_last_stage(metrics)  # the loss metrics exist on the last stage only

    def _run_schedule(self, model, micro: list[RolloutBatch], **kwargs: Any) -> list:
        max_len = max(max(m["total_lengths"]) for m in micro)
        return get_forward_backward_func()(
            forward_step_func=self.forward.step_func(
                self.args.loss, num_micro_batches=len(micro), **kwargs
            ),
            data_iterator=iter(micro),
            model=[model],
            num_microbatches=len(micro),
            seq_length=max_len,
            micro_batch_size=max(batch_size(m) for m in micro),
            forward_only=kwargs["forward_only"],
        )

    def logprob_gap(self, data_ref: Any) -> float:
        self._require_awake("logprob_gap")
        batch: RolloutBatch = data_ref
        ours = self._forward_log_probs(self.model, batch)
        gap = sum(
            float((o.double().cpu() - torch.as_tensor(t, dtype=torch.float64)).abs().sum())
            for o, t in zip(ours, batch["rollout_log_probs"], strict=True)
        )
        tokens = float(sum(len(t) for t in batch["rollout_log_probs"]))
        totals = torch.tensor([gap, tokens], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals, group=mpu.get_data_parallel_group())
        return float(totals[0] / max(float(totals[1]), 1.0))

    # -- checkpoints, weights, memory ------------------------------------------------------------

    def save_model(self, rollout_id: int) -> None:
        if not self.args.save:
            raise ValueError("save_model() needs a checkpoint directory: set --save")
        self._require_awake("save_model")
        checkpoint.save(
            self.args.save, rollout_id, self.model, self.optimizer, self.scheduler,
            extra={"weight_version": self.weight_version, "global_step": self.global_step,
                   "hf_checkpoint": str(self.args.hf_checkpoint)},
        )  # fmt: skip

    def export_hf(self, path: str | Path) -> None:
        self._require_awake("export_hf")
        export_hf_directory(
            self.model.module, path, hf_config=self.hf_config,
            tokenizer_path=self.args.hf_checkpoint, dtype=self._engine_dtype(),
            tp_group=mpu.get_tensor_model_parallel_group(),
            pp_group=mpu.get_pipeline_model_parallel_group(),
        )  # fmt: skip

    def _engine_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.mg.params_dtype == "bfloat16" else torch.float32

    def update_weights(self) -> None:
        if not self.args.engine_urls:
            raise ValueError("update_weights() has no engine to update: --engine-urls is empty")
        if self._updater is None:
            self._updater = self._make_updater()
        self.weight_version += 1
        # Colocated, the loop updates the engines while the trainer sleeps (the engines hold the
        # device then): the weights visit the device for the send and are freed again.
        params = list(self.model.module.parameters())
        visit = self._offloader.visiting(params) if self._asleep else contextlib.nullcontext()
        with visit:
            self._updater.update(str(self.weight_version))

    def _make_updater(self) -> WeightUpdater:
        dtype = self._engine_dtype()

        def named_tensors():
            return iter_hf_tensors(
                self.model.module, self.hf_config, dtype,
                mpu.get_tensor_model_parallel_group(), mpu.get_pipeline_model_parallel_group(),
            )  # fmt: skip

        return make_weight_updater(
            named_tensors, engine_urls=self.args.engine_urls, rank=self.rank,
            world_size=self.world_size, colocate=self.args.colocate,
            buffer_size=self.mg.update_weight_buffer_size, dtype=dtype,
            master_address=self.master_addr, group_name="miles-megatron-weights",
        )  # fmt: skip

    def sleep(self) -> None:
        """Free this rank's device memory (weights, gradients, optimizer state, reference model);
        the contents wait in host memory until `wake_up`. A no-op while asleep."""
        if self._asleep:
            return
        keep = [*self.model.module.parameters(), *self.model.module.buffers()]
        if self.ref_model is not None:
            keep += [*self.ref_model.parameters(), *self.ref_model.buffers()]
        keep += _optimizer_tensors(self.optimizer)
        # Megatron's DDP accumulates into `main_grad` views of its grad buffers; zeroed anyway
        # before the next step, so they are freed without a copy.
        grads = [getattr(p, "main_grad", None) for p in self.model.module.parameters()]
        self._offloader.offload(keep, discard=[g for g in grads if g is not None])
        self._asleep = True

    def wake_up(self) -> None:
        """Bring back what `sleep` freed. A no-op while awake (the loop wakes the trainer before
        every train step, also the first)."""
        if self._asleep:
            self._offloader.reload()
            self._asleep = False

    def _require_awake(self, call: str) -> None:
        # An offloaded tensor has no memory behind it: reading one would crash the process.
        if self._asleep:
            raise RuntimeError(f"{call}() while the trainer sleeps: call wake_up() first")

    def close(self) -> None:
        if self._updater is not None:
            self._updater.shutdown()
            self._updater = None


def _from_last_stage(value: Any) -> Any:
    """`value` as the last pipeline stage has it, on every stage (itself without pipelining)."""
    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(
        holder,
        src=mpu.get_pipeline_model_parallel_last_rank(),
        group=mpu.get_pipeline_model_parallel_group(),
    )
    return holder[0]


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Master weights and moments of a Megatron optimizer (chained or single)."""
    tensors = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = part.optimizer
        for group in inner.param_groups:
            tensors += group["params"]
        for state in inner.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _total_steps(args: Any) -> int | None:
    if not getattr(args, "num_rollout", None):
        return None
    return (
        args.num_rollout
        * args.rollout_batch_size
        * args.n_samples_per_prompt
        // (args.global_batch_size)
    )
