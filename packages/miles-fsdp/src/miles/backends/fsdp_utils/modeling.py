"""The FSDP2 model: built from a Hugging Face checkpoint read by rank 0 alone, sharded per
decoder layer, and run on packed micro-batches whose documents never see each other (varlen
boundaries for flash attention and Gated DeltaNet layers, one padded row per document otherwise).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForTokenClassification,
)

from miles.backends.fsdp_utils.gdn_packing import boundary_kwargs, enable_gdn_packing
from miles.backends.fsdp_utils.lora import add_adapters
from miles.backends.fsdp_utils.precision import PrecisionPolicy
from miles.backends.fsdp_utils.vision import idle_tower_term, vision_tower
from miles.backends.sglang_utils.vlm_checkpoint import is_vision_language
from miles.backends.training_utils.batching.packing import PackedBatch
from miles.config.lora_args import LoraArgs

logger = logging.getLogger(__name__)


def build_fsdp_model(
    hf_checkpoint: str | Path,
    *,
    mesh: DeviceMesh,
    device: torch.device,
    precision: PrecisionPolicy,
    attn_implementation: str,
    cpu_offload: bool,
    gradient_checkpointing: bool,
    trainable: bool = True,
    lora: LoraArgs | None = None,
    value_head: bool = False,
    freeze_vision_tower: bool = False,
) -> nn.Module:
    """Load the checkpoint on rank 0, shard it over `mesh`, and give every rank its shards.

    `lora`: add PEFT adapters to the targeted layers before sharding (the base frozen); rank 0
    initialises them (or reads --lora-adapter-path) and the other ranks receive them with the
    weights. `value_head`: PPO's value model, the checkpoint's transformer under a one-label
    token-classification head (new, initialised by rank 0, when the checkpoint has none).

    Order as in torchtitan: activation checkpointing is set on the layers before they become
    FSDP units; each decoder layer is its own unit (one all-gather per layer, overlapped with
    compute) and the root takes the rest (embeddings, final norm, a tied lm_head), so tied
    weights live in one unit and stay one parameter.
    """
    rank = dist.get_rank()
    head = {"num_labels": 1} if value_head else {}
    config = AutoConfig.from_pretrained(hf_checkpoint, **head)
    vision_language = is_vision_language(config)
    if value_head and vision_language:
        raise ValueError(
            f"{hf_checkpoint} is a vision-language model ({config.model_type}); a PPO critic "
            "built from it is not supported: use a text model as --critic-hf-checkpoint"
        )
    if value_head:
        auto = AutoModelForTokenClassification
    elif vision_language:  # the vision tower, its projector and the language model
        auto = AutoModelForImageTextToText
    else:
        auto = AutoModelForCausalLM
    if value_head:
        # transformers' token-classification head drops 10% of the final hidden states in
        # training unless the config says otherwise: a regression target fitted through noise
        # the values it gives (in eval mode) never see. A critic drops nothing, as on Megatron.
        # An attribute, not a keyword: from_pretrained ignores keywords the config class lacks.
        config.classifier_dropout = 0.0
    full_state: dict[str, torch.Tensor] = {}
    if rank == 0:
        model = auto.from_pretrained(
            hf_checkpoint, config=config, dtype=torch.float32,
            attn_implementation=attn_implementation,
        )  # fmt: skip
    else:
        # Same architecture, no memory: rank 0's weights arrive after sharding.
        with torch.device("meta"):
            model = auto.from_config(
                config, dtype=torch.float32, attn_implementation=attn_implementation
            )
    model.config.use_cache = False
    if freeze_vision_tower:
        if not vision_language:
            raise ValueError(
                f"--freeze-vision-tower: {hf_checkpoint} ({config.model_type}) has no vision "
                "tower; drop the flag"
            )
        # Before sharding: FSDP keeps each parameter's requires_grad, and the optimizer is built
        # from the trainable ones only.
        vision_tower(model).requires_grad_(False)
    enable_gdn_packing(model)  # before the forward ever sees a packed row
    if lora is not None:
        add_adapters(model, lora, load_weights=rank == 0)
    if rank == 0:
        full_state = model.state_dict()  # what the other ranks receive (with the adapters)
    if gradient_checkpointing and trainable:
        # Non-reentrant: it composes with FSDP2's autograd hooks (the reentrant one does not).
        if hasattr(model, "activation_checkpointing_enable"):  # the newer transformers name
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    if _needs_fsdp(mesh, precision, cpu_offload=cpu_offload):
        offload: OffloadPolicy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
        options = {"mesh": mesh, "mp_policy": precision.mixed_precision(),
                   "offload_policy": offload}  # fmt: skip
        for layer in _decoder_layers(model):
            fully_shard(layer, **options)
        fully_shard(model, **options)
        _load_full_state(model, full_state, device=device, cpu_offload=cpu_offload)
    else:
        # One rank, computing in the master dtype, nothing offloaded: FSDP2 would shard over
        # nobody and cast nothing, and its hooks and DTensor parameters cost ~7% of a small
        # model's step. torchtitan, too, applies fully_shard only when there is something to
        # shard. Rank 0, the only rank, loaded the checkpoint.
        logger.info("one rank in float32: the model is not wrapped by FSDP2")
        model.to(device)
    _check_tied(model)
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    return model


def _needs_fsdp(mesh: DeviceMesh, precision: PrecisionPolicy, *, cpu_offload: bool) -> bool:
    """Whether FSDP2 has anything to do: shard over more than one rank, cast parameters for
    compute (mixed precision), or keep them in host memory."""
    return mesh.size() > 1 or precision.param_dtype != precision.master_dtype or cpu_offload


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks, by the class names transformers marks as unsplittable."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class in _no_split_modules; the FSDP "
            "backend shards per decoder layer and cannot find them"
        )
    return layers


def _load_full_state(
    model: nn.Module, full_state: dict, *, device: torch.device, cpu_offload: bool
) -> None:
    """Materialise the shards and fill them from rank 0's full state dict (a broadcast)."""
    if dist.get_rank() == 0:
        model.to(device)
    else:
        model.to_empty(device=device)
    options = StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, cpu_offload=cpu_offload
    )
    set_model_state_dict(model, full_state, options=options)
    # Non-persistent buffers (rotary frequencies) are not in the state dict: after to_empty they
    # hold garbage everywhere but on rank 0.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    if cpu_offload:
        model.to("cpu")  # FSDP keeps offloaded shards in host memory; buffers stay on device
        for buffer in model.buffers():
            buffer.data = buffer.data.to(device)


def _check_tied(model: nn.Module) -> None:
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    output, embed = model.get_output_embeddings(), model.get_input_embeddings()
    assert output is None or output.weight is embed.weight, "sharding untied the embeddings"


def unreduced_grads(model: nn.Module) -> list[torch.Tensor]:
    """Gradients FSDP holds whole, not yet reduce-scattered (while gradient sync is off)."""
    grads = []
    for fsdp_param in _fsdp_params(model):
        accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        grads += [g for g in (accumulated, getattr(unsharded, "grad", None)) if g is not None]
    return grads


def discard_unreduced_grads(model: nn.Module) -> None:
    """Drop what `unreduced_grads` finds (FSDP2 has no public call for it: a step it was told
    not to sync is expected to finish)."""
    for fsdp_param in _fsdp_params(model):
        fsdp_param.unsharded_accumulated_grad = None
        if getattr(fsdp_param, "_unsharded_param", None) is not None:
            fsdp_param._unsharded_param.grad = None


def _fsdp_params(model: nn.Module) -> list:
    params = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                params += group.fsdp_params
    return params


# -- forward on packed micro-batches -----------------------------------------------------------


def runs_as_one_row(model: nn.Module, attn_implementation: str) -> bool:
    """Whether `packed_logits` runs a packed row as one sequence given its segment boundaries
    (flash attention, or a model with Gated DeltaNet layers) rather than as one padded row per
    document: the token order a MoE model's routers see."""
    return attn_implementation == "flash_attention_2" or enable_gdn_packing(model)


def packed_logits(
    model: nn.Module,
    packed: PackedBatch,
    *,
    attn_implementation: str,
    device: torch.device,
    positions: torch.Tensor | None = None,
    vision: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """(T, V) logits of a packed row, each document attending only to itself; with `positions`
    (indices into the packed row) only those rows, (len(positions), V), in that order.

    flash_attention_2, and any model with Gated DeltaNet layers, run the packed row as one
    sequence given its segment boundaries: varlen attention kernels take them (and sdpa / eager
    build a block-diagonal mask from the restarting position ids), and the GDN layers restart
    their recurrent state and short convolution at each one (`gdn_packing`). Other models on sdpa
    and eager run the documents as the rows of a right-padded batch instead: causal attention
    never lets a position see the padding after it, so no mask is needed, and the cost is sum of
    L_i^2 rather than the (sum L_i)^2 of a block-diagonal mask over the packed row. The logits
    come back in the packed row's layout.

    `positions` is handed to the model's own head as `logits_to_keep`, so the output projection
    (and its (T, V) activation and gradient, the largest of a step with a large vocabulary) runs
    only where a loss reads it: RL reads the response positions, not the prompt's.

    `vision`: a vision-language model's image keywords for the padded rows (`VisionInputs.of`).
    Such a model always runs padded rows: its multimodal rotary positions are computed per row
    from the image grids and the attention mask, which also keeps padding out of them.
    """
    keeps = positions is not None and _takes_logits_to_keep(model)
    if vision is None and runs_as_one_row(model, attn_implementation):
        input_ids = packed.input_ids.to(device)  # (1, T)
        position_ids = packed.position_ids.to(device)  # (1, T)
        segments = boundary_kwargs(packed.cu_seqlens_with_padding.to(device), packed.max_seqlen)
        if keeps:
            segments["logits_to_keep"] = positions.to(device)
        output = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **segments)
        logits = output.logits[0]
        return logits if keeps or positions is None else logits[positions.to(device)]
    lengths = packed.cu_seqlens.diff().tolist()
    documents = packed.input_ids[0, : int(packed.cu_seqlens[-1])].split(lengths)
    rows = torch.nn.utils.rnn.pad_sequence(documents, batch_first=True).to(device)  # (B, L)
    position_ids = torch.arange(rows.shape[1], device=device).expand_as(rows)  # (B, L)
    inputs: dict[str, torch.Tensor] = {"position_ids": position_ids}
    idle_tower = None
    if vision is not None:
        real = position_ids < torch.tensor(lengths, device=device).unsqueeze(-1)
        inputs = {"attention_mask": real.long(), **vision(rows)}
        rows = inputs.pop("input_ids")
        if "pixel_values" not in inputs:
            # No image here: the tower still runs (on a blank one), first, as it would on images,
            # so that every rank gathers and reduces its FSDP units in the same order.
            idle_tower = idle_tower_term(model, device)
    if keeps:
        # Packed position p of document d is column p - start(d) of row d. The head runs on the
        # columns any row needs (a prompt's columns below the shortest prompt are skipped).
        document = torch.searchsorted(packed.cu_seqlens, positions, right=True) - 1
        column = positions - packed.cu_seqlens[document]
        columns, index = torch.unique(column, return_inverse=True)
        logits = model(
            input_ids=rows, use_cache=False, logits_to_keep=columns.to(device), **inputs
        ).logits  # (B, len(columns), V)
        kept = logits[document.to(device), index.to(device)]  # one gather (see below)
        return kept if idle_tower is None else kept + idle_tower
    logits = model(input_ids=rows, use_cache=False, **inputs).logits  # (B, L, V)
    if idle_tower is not None:
        logits = logits + idle_tower
    # One boolean gather (row-major: the documents in order), not one slice per document: each
    # slice's backward writes a zero (B, L, V) gradient and adds it up, O(B^2) in the batch.
    real = position_ids < torch.tensor(lengths, device=device).unsqueeze(-1)  # (B, L)
    flat = logits[real]  # (sum L_i, V)
    if packed.num_pad_tokens:  # the row's trailing padding predicts nothing
        flat = torch.cat([flat, flat.new_zeros(packed.num_pad_tokens, flat.shape[-1])])
    return flat if positions is None else flat[positions.to(device)]  # (T, V)


def _takes_logits_to_keep(model: nn.Module) -> bool:
    """Whether the model's forward can compute only some positions' logits (transformers' causal
    LMs take `logits_to_keep`; a custom one may not)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def response_positions(packed: PackedBatch) -> torch.Tensor:
    """(sum R,) long: positions whose logits predict response tokens, documents in order."""
    pieces = [torch.arange(begin, end) for begin, end in packed.response_slices]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
