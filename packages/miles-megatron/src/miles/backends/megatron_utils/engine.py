"""`MegatronEngine`: the Megatron-core backend's `TrainEngine`, one rank of it.

Megatron's parallel state splits the ranks into tensor, pipeline, context and expert groups; the
model is a GPTModel built from the Hugging Face config (Qwen2, Qwen3, Llama) and loaded from the HF
weights; the optimizer is Megatron's (distributed by default). Megatron's schedules own the forward
and backward of every micro-batch (1F1B with pipelining), so the train step's loss callback runs
inside them, on the last pipeline stage; results are broadcast from there to the other stages.
PPO's critic is a second engine on the same ranks and groups (`value_model`), whose model ends in
a value head (`value_model.py`) and whose "log-probs" are values.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
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
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM

from miles.backends.megatron_utils import checkpoint
from miles.backends.megatron_utils.arguments import MegatronArgs, validate_against_hf
from miles.backends.megatron_utils.forward import MicroBatchForward
from miles.backends.megatron_utils.model_provider import (
    build_gpt_model,
    load_hf_weights,
    transformer_config_from_hf,
)
from miles.backends.megatron_utils.offload import StorageOffloader
from miles.backends.megatron_utils.parallel import (
    initialize_megatron_parallel,
    join_megatron_parallel,
)
from miles.backends.megatron_utils.value_model import ValueForward, value_model_state
from miles.backends.megatron_utils.weights import export_hf_directory, iter_hf_tensors
from miles.backends.training_utils.batching.rollout_data import RolloutBatch, batch_size
from miles.backends.training_utils.step.train_engine import (
    LoadedCheckpoint,
    MicroBatchLoss,
    OptimizerStepResult,
    paired_reference_parameters,
)
from miles.train_backend.run_spec import TrainRunSpec

logger = logging.getLogger(__name__)

# Megatron spells the decay styles its own way; wsd's final phase decays linearly, as FSDP's does.
_DECAY_STYLES = {"constant": "constant", "linear": "linear", "cosine": "cosine", "wsd": "WSD"}


class MegatronEngine:
    """One rank of the Megatron policy (and, when asked, a frozen reference model), or of PPO's
    value model (`value_model`: its "log-probs" are values, `CriticTrainer`'s engine)."""

    def __init__(
        self,
        args: MegatronArgs,
        spec: TrainRunSpec,
        *,
        device: torch.device,
        world_size: int,
        with_ref: bool,
        value_model: bool = False,
    ) -> None:
        if value_model and with_ref:
            raise ValueError("a value model has no reference model: build it with with_ref=False")
        self.mg, self.hf_checkpoint, self.device = args, spec.hf_checkpoint, device
        self.value_model = value_model
        # A value model is the checkpoint as a one-label token-classification model.
        head = {"num_labels": 1} if value_model else {}
        self.hf_config = AutoConfig.from_pretrained(spec.hf_checkpoint, **head)
        validate_against_hf(args, self.hf_config, world_size)
        if value_model and mpu.model_parallel_is_initialized():
            join_megatron_parallel(args)  # the policy's engine on these ranks formed them
        else:  # the policy, or a critic on ranks of its own (--critic-num-nodes)
            initialize_megatron_parallel(args)  # groups and the seeded RNG tracker
        torch.manual_seed(args.seed)
        self.dp_group = mpu.get_data_parallel_group()
        self.dp_size = mpu.get_data_parallel_world_size()
        # Tensor / pipeline / context-parallel peers hold one replica and train on one shard.
        self.dp_rank = mpu.get_data_parallel_rank()
        self.context_parallel_size = args.context_parallel_size
        self.engine_dtype = torch.bfloat16 if args.params_dtype == "bfloat16" else torch.float32
        self.transformer_config = transformer_config_from_hf(self.hf_config, args)
        # Megatron's schedules call this after the backward: data-parallel gradient averaging and
        # the tensor-parallel sums of replicated parameters (e.g. Qwen3's q/k norms).
        self.transformer_config.finalize_model_grads_func = finalize_model_grads
        self.model = self._build_model(trainable=True)
        # --ref-load: a reference model other than the start checkpoint.
        self.ref_checkpoint = spec.ref_load or spec.hf_checkpoint
        self.ref_model = self._build_model(trainable=False) if with_ref else None
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=args.lr,
                min_lr=args.min_lr,
                weight_decay=args.weight_decay,
                adam_beta1=args.adam_beta1,
                adam_beta2=args.adam_beta2,
                adam_eps=args.adam_eps,
                clip_grad=args.clip_grad,
                bf16=args.params_dtype == "bfloat16",
                params_dtype=getattr(torch, args.params_dtype),
                use_distributed_optimizer=args.use_distributed_optimizer,
            ),
            [self.model],
        )
        self.scheduler = build_lr_scheduler(self.optimizer, args, spec.total_optimizer_steps)
        self.forward = (ValueForward if value_model else MicroBatchForward)(
            hf_config=self.hf_config, temperature=spec.rollout_temperature, device=device,
            cp_group=mpu.get_context_parallel_group(),
        )  # fmt: skip
        self._offloader = StorageOffloader(device)
        self._asleep = False

    def _build_model(self, *, trainable: bool) -> torch.nn.Module:
        source = self.hf_checkpoint if trainable else self.ref_checkpoint
        # The reference model is shaped by its own checkpoint's config (--ref-load may name
        # another architecture than the policy's), over the policy's vocabulary.
        hf_config = self.hf_config if trainable else _reference_config(source, self.hf_config)
        model = build_gpt_model(
            hf_config,
            self.mg,
            pre_process=mpu.is_pipeline_first_stage(),
            post_process=mpu.is_pipeline_last_stage(),
            value_head=self.value_model,
        ).to(self.device)
        # Every rank reads the HF weights and keeps its own tensor-parallel slices of them.
        load_hf_weights(
            model, self._hf_state(source, hf_config), hf_config, self.mg,
            value_head=self.value_model,
        )  # fmt: skip
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

    def _hf_state(self, source: str, hf_config: Any) -> dict[str, Tensor]:
        if self.value_model:
            return value_model_state(source, hf_config, seed=self.mg.seed)
        return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()

    @torch.no_grad()
    def update_reference(self) -> None:
        """Copy the policy's weights (this rank's tensor- and pipeline-parallel slices) into the
        reference model, which is built alike: no communication."""
        if self.ref_model is None:
            raise RuntimeError("update_reference() asked of an engine built without with_ref")
        pairs = paired_reference_parameters(
            dict(self.model.module.named_parameters()),
            dict(self.ref_model.named_parameters()),
            ref_checkpoint=self.ref_checkpoint,
            checkpoint=self.hf_checkpoint,
        )
        for source, ref in pairs:
            ref.copy_(source)

    # -- forward and backward -----------------------------------------------------------------

    def forward_log_probs(
        self, micro_batches: Sequence[RolloutBatch], *, reference: bool = False
    ) -> list[Tensor]:
        model = self.ref_model if reference else self.model
        if model is None:
            raise RuntimeError("reference log-probs asked of an engine built without with_ref")
        # Megatron's forward-only schedule keeps autograd on: without this every activation of
        # the pass would stay alive as in training.
        with torch.no_grad():
            outputs = self._run_schedule(model, micro_batches, loss_fn=None)
        # Only the last stage has logits; the other stages need the values for advantages.
        return _from_last_stage([item["log_probs"] for item in outputs])

    def forward_backward(
        self, micro_batches: Sequence[RolloutBatch], loss_fn: MicroBatchLoss
    ) -> list[dict[str, Tensor]]:
        outputs = self._run_schedule(self.model, micro_batches, loss_fn=loss_fn)
        metrics = [{k: v.detach().cpu() for k, v in item["metrics"].items()} for item in outputs]
        return _from_last_stage(metrics)  # the loss metrics exist on the last stage only

    def _run_schedule(
        self, model: Any, micro_batches: Sequence[RolloutBatch], *, loss_fn: MicroBatchLoss | None
    ) -> list[dict]:
        count = len(micro_batches)
        return get_forward_backward_func()(
            forward_step_func=self.forward.step_func(num_micro_batches=count, loss_fn=loss_fn),
            data_iterator=iter(enumerate(micro_batches)),
            model=[model],
            num_microbatches=count,
            seq_length=max(max(m["total_lengths"]) for m in micro_batches),
            micro_batch_size=max(batch_size(m) for m in micro_batches),
            forward_only=loss_fn is None,
        )

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> OptimizerStepResult:
        lr = self.optimizer.param_groups[0]["lr"]
        applied, grad_norm, _ = self.optimizer.step()
        if applied:
            self.scheduler.step(increment=1)
        return OptimizerStepResult(grad_norm=float(grad_norm or 0.0), lr=lr, applied=applied)

    # -- weights, checkpoints, memory ---------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        return iter_hf_tensors(
            self.model.module, self.hf_config, self.engine_dtype,
            mpu.get_tensor_model_parallel_group(), mpu.get_pipeline_model_parallel_group(),
        )  # fmt: skip

    def weights_on_device(self) -> contextlib.AbstractContextManager[None]:
        # Asleep, the weights have no device memory: they visit the device for the push.
        if not self._asleep:
            return contextlib.nullcontext()
        return self._offloader.visiting(list(self.model.module.parameters()))

    def save(self, directory: str, rollout_id: int, extra: dict, *, commit: bool = True) -> None:
        checkpoint.save(
            directory,
            rollout_id,
            self.model,
            self.optimizer,
            self.scheduler,
            extra=extra,
            commit=commit,
        )

    def load(self, directory: str) -> LoadedCheckpoint | None:
        meta = checkpoint.load(directory, self.model, self.optimizer, self.scheduler)
        if meta is None:
            return None
        extra = {k: v for k, v in meta.items() if k not in ("rollout_id", "world_size")}
        return LoadedCheckpoint(rollout_id=int(meta["rollout_id"]), extra=extra)

    def export_hf(self, path: str | Path) -> None:
        export_hf_directory(
            self.model.module, path, hf_config=self.hf_config,
            tokenizer_path=self.hf_checkpoint, dtype=self.engine_dtype,
            tp_group=mpu.get_tensor_model_parallel_group(),
            pp_group=mpu.get_pipeline_model_parallel_group(), value_head=self.value_model,
        )  # fmt: skip

    def sleep(self) -> None:
        """Free this rank's device memory (weights, gradients, optimizer state, reference model);
        the contents wait in host memory until `wake_up`."""
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
        self._offloader.reload()
        self._asleep = False


def build_lr_scheduler(optimizer: Any, args: MegatronArgs, total_steps: int) -> Any:
    """Megatron's scheduler for the shared schedule flags: step for step the rates of the FSDP
    backend's `LRSchedule` (warmup from 0, then constant, linear, cosine or warmup-stable-decay).
    `--lr-decay-iters` defaults to the run's optimizer steps."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_iters or total_steps,
        lr_decay_style=_DECAY_STYLES[args.lr_decay_style],
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
        wsd_decay_steps=args.lr_wsd_decay_iters,
        lr_wsd_decay_style="linear" if args.lr_decay_style == "wsd" else None,
    )


def _reference_config(checkpoint: str, policy_config: Any) -> Any:
    """The HF config of the reference model's checkpoint; its vocabulary must be the policy's
    (the forward keeps the first `vocab_size` logits, and the KL compares the two over it)."""
    config = AutoConfig.from_pretrained(checkpoint)
    if config.vocab_size != policy_config.vocab_size:
        raise ValueError(
            f"the reference model (--ref-load {checkpoint}) has a vocabulary of "
            f"{config.vocab_size} tokens, the policy {policy_config.vocab_size}; the KL to the "
            "reference needs one vocabulary: use a reference checkpoint with the policy's"
        )
    return config


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
