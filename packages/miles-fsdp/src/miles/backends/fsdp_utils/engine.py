"""`FSDPEngine`: the FSDP2 backend's `TrainEngine` (model, optimizer, schedule, one rank of them).

Rank 0 alone reads the Hugging Face checkpoint; the other ranks build the model on the meta device
and receive their shards from rank 0. Micro-batches are packed; sdpa and eager run their documents
as the rows of a right-padded batch, flash attention runs the packed row with restarting position
ids, so no token ever attends across documents. The RL step itself is training-utils'
`PolicyTrainer`; this module only runs micro-batches through the sharded model.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils import checkpoint
from miles.backends.fsdp_utils.arguments import FSDPArgs
from miles.backends.fsdp_utils.lora import (
    adapter_config,
    adapter_weights,
    adapters_disabled,
    merged_weights,
)
from miles.backends.fsdp_utils.lr_scheduler import get_lr_scheduler
from miles.backends.fsdp_utils.modeling import (
    build_fsdp_model,
    discard_unreduced_grads,
    packed_logits,
    response_positions,
    runs_as_one_row,
)
from miles.backends.fsdp_utils.moe_stats import MoEStats
from miles.backends.fsdp_utils.parallel import build_fsdp_meshes, create_fsdp_parallel_state
from miles.backends.fsdp_utils.precision import PrecisionPolicy
from miles.backends.fsdp_utils.prompt_sharing import (
    SharedPrompts,
    plan_shared_prompts,
    prompt_sharing_unsupported,
    shared_prompt_logits,
)
from miles.backends.fsdp_utils.routing import PackedRouting, Phase, real_tokens
from miles.backends.fsdp_utils.update_weight_utils import iter_full_tensors
from miles.backends.fsdp_utils.vision import VisionInputs
from miles.backends.sglang_utils.vlm_checkpoint import checkpoint_names, is_vision_language
from miles.backends.sglang_utils.weight_sync.expert_layout import split_fused_experts
from miles.backends.training_utils.batching.packing import PackedBatch
from miles.backends.training_utils.batching.rollout_data import RolloutBatch
from miles.backends.training_utils.batching.train_batches import get_batch, token_rows
from miles.backends.training_utils.infra.device import (
    collective_device,
    empty_cache,
    get_device_info,
    synchronize,
)
from miles.backends.training_utils.step.logprobs import get_log_probs_and_entropy
from miles.backends.training_utils.step.routing_replay import moe_routers
from miles.backends.training_utils.step.train_engine import (
    SCORED_TOKEN_IDS,
    LoadedCheckpoint,
    MicroBatchLoss,
    OptimizerStepResult,
    paired_reference_parameters,
)
from miles.config.lora_args import LoraArgs
from miles.train_backend.run_spec import TrainRunSpec

logger = logging.getLogger(__name__)


def check_device_support(args: FSDPArgs) -> None:
    """Refuse what this machine's device makes pointless (FSDPArgs is built on the driver, which
    may have another device than the train ranks)."""
    if args.fsdp_cpu_offload and not get_device_info().is_accelerator:
        raise ValueError(
            "--fsdp-cpu-offload has no effect on CPU: parameters already live in host memory; "
            "drop the flag"
        )


class FSDPEngine:
    """One rank of the FSDP2 policy (and, when asked, a frozen reference model), or of PPO's
    value model (`value_model`: its "log-probs" are values, `CriticTrainer`'s engine)."""

    def __init__(
        self,
        args: FSDPArgs,
        spec: TrainRunSpec,
        *,
        device: torch.device,
        world_size: int,
        with_ref: bool,
        value_model: bool = False,
    ) -> None:
        check_device_support(args)
        self.args, self.hf_checkpoint = args, spec.hf_checkpoint
        self.temperature, self.device = spec.rollout_temperature, device
        meshes = build_fsdp_meshes(
            device.type, world_size, args.context_parallel_size, args.dp_replicate_size
        )
        dp = create_fsdp_parallel_state(meshes).dp
        self.dp_group, self.dp_size, self.dp_rank = dp.group, dp.size, dp.rank
        self.context_parallel_size = 1  # FSDPArgs refuses more
        self.precision = PrecisionPolicy.from_args(args, get_device_info().kind)
        self.engine_dtype = self.precision.engine_dtype
        self.lora: LoraArgs | None = args if args.uses_lora else None
        self.value_model = value_model
        self.model = self._build_model(meshes["fsdp"], trainable=True)
        config = self.model.config
        # A VLM: its images' pixel inputs for every forward, and its weights under the names of
        # its checkpoint (which transformers renames on load) for weight sync.
        self.vision = (
            VisionInputs(spec.hf_checkpoint, config)
            if is_vision_language(config) and not value_model
            else None
        )
        self.checkpoint_names = checkpoint_names(config)
        self.routing = (
            PackedRouting(self.model, spec.routing_replay, args.attn_implementation)
            if spec.routing_replay is not None
            else None
        )
        self.moe = self._moe_stats(args)
        gather = args.fsdp_gather
        self.gather_per_step = isinstance(self.model, FSDPModule) and (
            gather == "step" or (gather == "auto" and device.type == "cpu")
        )
        # --ref-load: a reference model other than the start checkpoint.
        self.ref_checkpoint = spec.ref_load or spec.hf_checkpoint
        # LoRA: the policy with its adapters off is the start checkpoint, the reference itself.
        self.ref_is_base = (
            with_ref and self.lora is not None and self.ref_checkpoint == spec.hf_checkpoint
        )
        self.ref_model = (
            self._build_model(meshes["fsdp"], trainable=False)
            if with_ref and not self.ref_is_base
            else None
        )
        # --ref-load may name another architecture than the policy's: each model says for itself.
        # A value model's head reads hidden states, which the shared-prompt forward (made for
        # the LM head's logits) does not hand out.
        self.sharing_models = {
            id(model)
            for model in (self.model, self.ref_model)
            if model is not None and args.share_prompt_forward and not value_model
            and _can_share_prompts(model, args)
        }  # fmt: skip
        # fused: one kernel over all parameters. On CPU it took 2.6 ms a step against 12-16 ms
        # for foreach (3.2M parameters, one thread) and 12% of a small model's step for the
        # per-parameter loop, torch's CPU default. foreach where the device has no fused kernel.
        # Only what trains has optimizer state: with LoRA, the adapters (the base is frozen).
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=args.lr,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps,
            weight_decay=args.weight_decay,
            **_multi_tensor_kernel(device),
        )
        self.lr_scheduler = get_lr_scheduler(
            self.optimizer,
            decay_style=args.lr_decay_style,
            lr=args.lr,
            min_lr=args.min_lr,
            warmup_iters=args.lr_warmup_iters,
            decay_iters=args.lr_decay_iters or spec.total_optimizer_steps,
            wsd_decay_iters=args.lr_wsd_decay_iters,
        )

    def _build_model(self, mesh: DeviceMesh, *, trainable: bool) -> nn.Module:
        # The frozen reference model only runs forward passes: on accelerators its shards wait
        # in host memory and visit the device per layer.
        offload = self.args.fsdp_cpu_offload if trainable else get_device_info().is_accelerator
        return build_fsdp_model(
            self.hf_checkpoint if trainable else self.ref_checkpoint,
            mesh=mesh,
            device=self.device,
            precision=self.precision,
            attn_implementation=self.args.attn_implementation,
            cpu_offload=offload,
            gradient_checkpointing=self.args.gradient_checkpointing,
            trainable=trainable,
            lora=self.lora if trainable else None,
            value_head=self.value_model,
            freeze_vision_tower=self.args.freeze_vision_tower and trainable,
        )

    def _moe_stats(self, args: FSDPArgs) -> MoEStats | None:
        """Routing metrics and the load-balancing loss, for a MoE model."""
        if not moe_routers(self.model):
            if args.moe_aux_loss_coef:
                raise ValueError(
                    f"--moe-aux-loss-coef {args.moe_aux_loss_coef} weighs a MoE load-balancing "
                    f"loss, but {self.hf_checkpoint} is a dense model; drop the flag"
                )
            return None
        coef = args.moe_aux_loss_coef
        if coef is None:
            coef = float(getattr(self.model.config, "router_aux_loss_coef", 0.0) or 0.0)
        return MoEStats(self.model, coef)

    # -- forward and backward -----------------------------------------------------------------

    def _log_probs(
        self,
        model: nn.Module,
        micro: RolloutBatch,
        phase: Phase | None = None,
        moe: dict[str, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """(sum R,) log-probs and entropies of a micro-batch's response tokens, and the (sum R, K)
        log-probs of its `SCORED_TOKEN_IDS` when it has them; `phase`: a policy forward, routed
        as routing replay says; `moe`: filled with the MoE routers' load-balancing loss and
        metrics of this forward."""
        packed = get_batch(micro, ())["packed"]
        with contextlib.ExitStack() as stack:
            if self.routing is not None and phase is not None:
                stack.enter_context(self.routing.around(micro, packed, phase))
            if moe is not None and self.moe is not None:
                real = real_tokens(packed, runs_as_one_row(model, self.args.attn_implementation))
                stack.enter_context(self.moe.measuring(real, into=moe))
            positions = response_positions(packed)  # (sum R,)
            shared = self._shared_prompts(model, packed)
            if shared is not None:
                logits = shared_prompt_logits(model, shared, self.device)  # (sum R, V)
            else:
                vision = self.vision
                logits = packed_logits(
                    model, packed, attn_implementation=self.args.attn_implementation,
                    device=self.device, positions=positions,
                    vision=None if vision is None else lambda rows: vision.of(micro, rows, self.device),
                )  # (sum R, V): only where a response token is predicted  # fmt: skip
        if self.value_model:  # (sum R, 1): the value of the state before each response token
            values = logits[:, 0].float()
            return values, torch.zeros_like(values), None
        positions = positions.to(self.device)
        targets = packed.input_ids[0].to(self.device)[positions + 1]  # (sum R,)
        scored = SCORED_TOKEN_IDS in micro
        if scored:  # (sum R, 1 + K): each target, then the K ids also scored there
            ids = token_rows(micro, SCORED_TOKEN_IDS, torch.long).to(self.device)
            targets = torch.cat([targets.unsqueeze(-1), ids], dim=-1)
        log_probs, entropy = get_log_probs_and_entropy(
            logits, targets, temperature=self.temperature
        )
        if not scored:
            return log_probs, entropy, None
        return log_probs[:, 0], entropy, log_probs[:, 1:]

    def _shared_prompts(self, model: nn.Module, packed: PackedBatch) -> SharedPrompts | None:
        """The micro-batch's shared-prompt layout where every rank has one. A layout forwards
        the model twice, and each forward runs FSDP's per-layer collectives: a rank alone on
        it would leave the others waiting on gathers they never make."""
        if id(model) not in self.sharing_models:
            return None
        plan = plan_shared_prompts(packed)
        if self.dp_size == 1:
            return plan
        every_rank = torch.tensor([plan is not None], device=collective_device(self.dp_group))
        dist.all_reduce(every_rank, op=dist.ReduceOp.MIN, group=self.dp_group)
        return plan if bool(every_rank) else None

    def forward_log_probs(
        self, micro_batches: Sequence[RolloutBatch], *, reference: bool = False
    ) -> list[Tensor]:
        model = self.model if not reference or self.ref_is_base else self.ref_model
        if model is None:
            raise RuntimeError("reference log-probs asked of an engine built without with_ref")
        was_training = model.training
        model.eval()
        phase: Phase | None = None if reference else "old_policy"
        if self.routing is not None and not reference:
            self.routing.start_old_policy_pass()
        base = adapters_disabled(model) if reference and self.ref_is_base else nullcontext()
        with torch.no_grad(), base:
            out = [self._log_probs(model, micro, phase)[0].float().cpu() for micro in micro_batches]
        model.train(was_training)
        return out

    def forward_backward(
        self, micro_batches: Sequence[RolloutBatch], loss_fn: MicroBatchLoss
    ) -> list[dict[str, Tensor]]:
        self.model.train()
        metrics = []
        with self._gathered_for_the_step(len(micro_batches)) as before:
            for index, micro in enumerate(micro_batches):
                before(index)
                moe: dict[str, Tensor] = {}
                log_probs, entropy, scored = self._log_probs(self.model, micro, "train", moe)
                loss, pairs = loss_fn(index, log_probs, entropy, scored)
                if moe:
                    aux = moe.pop("aux_loss")
                    if self.moe is not None and self.moe.aux_loss_coef:
                        # An average over the step's micro-batches, as the policy loss is.
                        loss = loss + self.moe.aux_loss_coef * aux / len(micro_batches)
                    pairs = {**pairs, **moe}
                loss.backward()
                metrics.append(pairs)
        return metrics

    @contextlib.contextmanager
    def _gathered_for_the_step(self, count: int) -> Iterator[Callable[[int], None]]:
        """--fsdp-gather step: the parameters gathered by the first micro-batch's forward stay
        gathered until the last one's backward, which alone reduce-scatters the gradients the
        micro-batches accumulated. Yields the hook to call before micro-batch `index`; afterwards
        (or on a failure midway) the model is sharded as FSDP2 leaves it by default."""
        if not self.gather_per_step:
            yield lambda index: None
            return

        def before(index: int) -> None:
            last = index == count - 1
            self.model.set_requires_gradient_sync(last)
            self.model.set_reshard_after_backward(last)

        self.model.set_reshard_after_forward(False)
        try:
            yield before
        except BaseException:
            # A failure midway leaves layers gathered and the earlier micro-batches' gradients
            # accumulated whole, outside the sharded .grad that zero_grad clears: the next step
            # would reduce them with its own.
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()  # per module, not recursive
            discard_unreduced_grads(self.model)
            raise
        finally:
            self.model.set_reshard_after_forward(True)
            self.model.set_reshard_after_backward(True)
            self.model.set_requires_gradient_sync(True)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def update_reference(self) -> None:
        """Copy the policy's shards into the reference model's: both are sharded alike, so each
        rank copies its own shards, in float32, with no communication."""
        if self.ref_is_base:
            raise ValueError(
                "--ref-update-interval: with LoRA the reference is the frozen base the policy "
                "shares (its adapters off), which cannot take the policy's weights"
            )
        if self.ref_model is None:
            raise RuntimeError("update_reference() asked of an engine built without with_ref")
        for model in (self.model, self.ref_model):  # the root may still hold gathered weights
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        pairs = paired_reference_parameters(
            dict(self.model.named_parameters()),
            dict(self.ref_model.named_parameters()),
            ref_checkpoint=self.ref_checkpoint,
            checkpoint=self.hf_checkpoint,
        )
        for source, ref in pairs:
            _local(ref).copy_(_local(source))

    def optimizer_step(self) -> OptimizerStepResult:
        """Clip by the norm of the full gradient (over every shard), then step."""
        lr = self.optimizer.param_groups[0]["lr"]
        params = [p for p in self.model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if isinstance(total, DTensor):
            total = total.full_tensor()  # the local norms are partial: reduce them over the mesh
        grad_norm = float(total)
        if not math.isfinite(grad_norm):
            # Every rank sees the same full norm, so every rank skips together.
            self.optimizer.zero_grad(set_to_none=True)
            return OptimizerStepResult(grad_norm=grad_norm, lr=lr, applied=False)
        if self.args.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.args.clip_grad, total)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return OptimizerStepResult(grad_norm=grad_norm, lr=lr, applied=True)

    # -- weights, checkpoints, memory ---------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        if self.lora is not None:
            # The base never changes: only the adapted layers, merged, are new to an engine.
            weights = merged_weights(self.model, self.engine_dtype)
        else:
            # Engines take MoE experts per expert, as checkpoints hold them (SGLang's loaders).
            weights = split_fused_experts(iter_full_tensors(self.model, self.engine_dtype))
        if not self.checkpoint_names:
            return weights
        renames = self.checkpoint_names
        return ((renames.get(name, name), tensor) for name, tensor in weights)

    def adapter_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(PEFT name, full float32 tensor) of every adapter matrix (--lora-sync adapter);
        a collective, every rank drains it."""
        if self.lora is None:
            raise RuntimeError("adapter_weights() of a model without LoRA adapters")
        return adapter_weights(self.model)

    def adapter_config(self) -> dict[str, Any]:
        """The adapter_config.json of the trained adapter."""
        if self.lora is None:
            raise RuntimeError("adapter_config() of a model without LoRA adapters")
        return adapter_config(self.model, self.hf_checkpoint)

    def weights_on_device(self) -> contextlib.AbstractContextManager[None]:
        # A sleeping FSDP model sits in host memory, where its shards stay readable.
        return contextlib.nullcontext()

    def save(self, directory: str, rollout_id: int, extra: dict, *, commit: bool = True) -> None:
        if self.lora is not None:
            # The adapters alone are saved (the base is --hf-checkpoint); export rebuilds them.
            extra = {**extra, checkpoint.LORA_CONFIG_KEY: self.adapter_config()}
        if self.value_model:  # export rebuilds a token-classification model with one label
            extra = {**extra, checkpoint.VALUE_MODEL_KEY: True}
        checkpoint.save_checkpoint(
            directory,
            rollout_id,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            extra_meta=extra,
            commit=commit,
            trainable_only=self.lora is not None,
        )

    def load(self, directory: str) -> LoadedCheckpoint | None:
        meta = checkpoint.load_checkpoint(
            directory, model=self.model, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            trainable_only=self.lora is not None,
        )  # fmt: skip
        if meta is None:
            return None
        return LoadedCheckpoint(rollout_id=int(meta["rollout_id"]), extra=meta.get("extra", {}))

    def export_hf(self, path: str | Path) -> None:
        checkpoint.export_hf(
            self.model,
            path,
            config=self.model.config,
            tokenizer_path=self.hf_checkpoint,
            dtype=self.engine_dtype,
        )

    def sleep(self) -> None:
        """Parameters, gradients and optimizer state to host memory (on CPU: nothing to free)."""
        self._move_to(torch.device("cpu"))

    def wake_up(self) -> None:
        self._move_to(self.device)

    def _move_to(self, device: torch.device) -> None:
        if not get_device_info().is_accelerator:
            logger.info("on CPU, sleep/wake_up keep the training state in place")
            return
        # With --fsdp-cpu-offload FSDP already keeps shards, gradients and optimizer state on the
        # host; the frozen reference model is always offloaded on accelerators.
        if not self.args.fsdp_cpu_offload:
            self.model.to(device)  # moves gradients along with their parameters
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        state[key] = value.to(device, non_blocking=True)
        synchronize()
        empty_cache()


def _multi_tensor_kernel(device: torch.device) -> dict[str, bool]:
    """AdamW's fused kernel where torch has one for `device`, else its foreach kernel."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    fused = device.type in _get_fused_kernels_supported_devices()
    return {"fused": True} if fused else {"foreach": True}


def _can_share_prompts(model: nn.Module, args: FSDPArgs) -> bool:
    why_not = prompt_sharing_unsupported(
        model,
        attn_implementation=args.attn_implementation,
        gradient_checkpointing=bool(getattr(model, "is_gradient_checkpointing", False)),
        moe=bool(moe_routers(model)),
        packs_one_row=runs_as_one_row(model, args.attn_implementation),
    )
    if why_not is not None:
        logger.info("--share-prompt-forward: each sample forwards its prompt: %s", why_not)
    return why_not is None


def _local(tensor: Tensor) -> Tensor:
    """This rank's shard of a (sharded) parameter."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
