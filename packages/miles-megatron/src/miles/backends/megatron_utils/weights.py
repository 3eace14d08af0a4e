"""A Megatron model's weights under Hugging Face names: for weight sync and for HF export.

Every rank walks its parameters in the same order and gathers each tensor-parallel shard (a
collective over the tensor-parallel group), then the converter renames and re-lays it out (fused QKV
and gated MLP split, vocabulary padding dropped, a pipeline stage's local layer numbers made
global), so engines receive exactly what the HF checkpoint holds. With pipeline parallelism the
stages then take turns broadcasting their tensors over the pipeline group, one at a time, so every
rank yields the whole model without holding more than one extra tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from miles.backends.megatron_utils.convert import megatron_to_hf_named
from miles.backends.megatron_utils.model_provider import global_layer_names
from miles.backends.megatron_utils.tp_sharding import gather_tp_param

logger = logging.getLogger(__name__)


def iter_hf_tensors(
    model: torch.nn.Module,
    hf_config: Any,
    dtype: torch.dtype | None,
    tp_group: Any = None,
    pp_group: Any = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) pairs of the whole model; every rank must drain it.

    `model` is one rank's unwrapped GPTModel (a pipeline stage's when `pp_group` has more than one
    rank). Floating tensors are cast before the gather, so the gather moves engine-dtype bytes.
    """
    stage = _stage_hf_tensors(model, hf_config, dtype, tp_group)
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        yield from stage
        return
    device = next(model.parameters()).device
    for source in dist.get_process_group_ranks(pp_group):
        mine = dist.get_rank() == source
        while True:
            item = next(stage, None) if mine else None
            header = [None if item is None else (item[0], item[1].shape, item[1].dtype)]
            dist.broadcast_object_list(header, src=source, group=pp_group)
            if header[0] is None:  # this stage has sent all its tensors
                break
            name, shape, tensor_dtype = header[0]
            tensor = (
                item[1].contiguous()
                if mine
                else torch.empty(shape, dtype=tensor_dtype, device=device)
            )
            dist.broadcast(tensor, src=source, group=pp_group)
            yield name, tensor


def _stage_hf_tensors(
    model: torch.nn.Module, hf_config: Any, dtype: torch.dtype | None, tp_group: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF pairs of this pipeline stage's parameters, under global layer numbers."""
    global_name = global_layer_names(model)
    for name, param in model.named_parameters():
        local = param.detach()
        if dtype is not None and local.is_floating_point():
            local = local.to(dtype)
        full = gather_tp_param(name, local, hf_config, group=tp_group)
        yield from megatron_to_hf_named(global_name(name), full, hf_config)


def export_hf_directory(
    model: torch.nn.Module,
    out_dir: str | Path,
    *,
    hf_config: Any,
    tokenizer_path: str | None,
    dtype: torch.dtype,
    tp_group: Any = None,
    pp_group: Any = None,
    value_head: bool = False,
) -> None:
    """Write a directory `AutoModelForCausalLM.from_pretrained` loads (with `value_head`, PPO's
    value model: `AutoModelForTokenClassification`, one label); every rank calls it."""
    pairs = iter_hf_tensors(model, hf_config, dtype, tp_group, pp_group)
    tensors = {name: t.cpu() for name, t in pairs}
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        auto = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
        hf_model = auto.from_config(hf_config, dtype=dtype)
        missing, unexpected = hf_model.load_state_dict(tensors, strict=False)
        # A tied lm_head is not a separate tensor in either model.
        missing = [
            m for m in missing if not (m == "lm_head.weight" and hf_config.tie_word_embeddings)
        ]
        if missing or unexpected:
            raise RuntimeError(
                f"converted weights do not match the HF model: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}"
            )
        hf_model.save_pretrained(out)
        if tokenizer_path is not None:
            AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(out)
        logger.info("exported %d tensors (%s) to %s", len(tensors), dtype, out)
    if dist.is_initialized():
        dist.barrier()
