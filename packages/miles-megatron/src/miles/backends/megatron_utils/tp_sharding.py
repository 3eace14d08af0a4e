"""How Megatron splits each GPTModel parameter over tensor-parallel ranks, and how to undo it.

Column-parallel (dim 0): linear_qkv (whole query groups per rank), linear_fc1 (gate and up
halves split separately), word embeddings and output layer (vocabulary rows). Row-parallel
(dim 1): linear_proj and linear_fc2 weights. Everything else (layernorms, row-parallel biases,
the value model's one-output `score` head) is replicated. Used to rebuild full parameters for
weight sync and HF export, and in tests.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles.backends.megatron_utils.convert import attention_dims

_COLUMN_PARALLEL = ("linear_qkv", "linear_fc1", "word_embeddings", "output_layer")
_ROW_PARALLEL = ("linear_proj", "linear_fc2")
_REPLICATED_LEAVES = ("layer_norm_weight", "layer_norm_bias")  # norms fused into TE linears
_REPLICATED_OWNERS = ("score",)  # the value head (value_model.ValueHead): one row, not split


def tp_partition_dim(name: str) -> int | None:
    """The dim Megatron splits parameter `name` along: 0 column-parallel, 1 row-parallel, None
    replicated. Raises for a name it does not know, rather than guess a layout."""
    parts = name.split(".")
    leaf = parts[-1]
    owner = parts[-2] if len(parts) > 1 else ""
    if leaf in _REPLICATED_LEAVES or owner.endswith("layernorm") or owner in _REPLICATED_OWNERS:
        return None
    if owner in _COLUMN_PARALLEL and leaf in ("weight", "bias"):
        return 0
    if owner in _ROW_PARALLEL:
        # A row-parallel layer adds its bias after the all-reduce: every rank holds all of it.
        return 1 if leaf == "weight" else None
    raise ValueError(f"no tensor-parallel layout known for Megatron parameter {name!r}")


def tp_shard(name: str, full: Tensor, tp_rank: int, tp_size: int, hf_config: Any) -> Tensor:
    """Rank `tp_rank`'s slice of the full Megatron parameter `name` (replicated: `full`)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    dim = tp_partition_dim(name)
    if dim is None or tp_size == 1:
        return full
    _check_divisible(name, full, dim, tp_size, hf_config)
    if _is_fc1(name):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]], dim=0)
    # linear_qkv needs no special case: its rows are grouped by query group, so equal
    # contiguous chunks of whole groups are exactly Megatron's per-rank layout.
    return full.chunk(tp_size, dim=dim)[tp_rank].contiguous()


def tp_gather(name: str, shards: list[Tensor], hf_config: Any) -> Tensor:
    """The full parameter `name` from every rank's shard, in rank order: inverse of `tp_shard`."""
    dim = tp_partition_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if _is_fc1(name):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def gather_tp_param(name: str, local: Tensor, hf_config: Any, group: Any = None) -> Tensor:
    """The full parameter `name` from this rank's shard `local`; every rank of the group calls it.

    `group` is the tensor-parallel process group; None means Megatron's tensor-parallel group
    when megatron's parallel state is initialised, else a single process (nothing to gather).
    Replicated parameters come back as they are, without communication.
    """
    dim = tp_partition_dim(name)
    if dim is None:
        return local
    group = _default_tp_group() if group is None else group
    world = 1 if group is None else dist.get_world_size(group)
    if world == 1:
        return local
    local = local.contiguous()
    shards = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(shards, local, group=group)
    return tp_gather(name, shards, hf_config)


def _default_tp_group() -> Any:
    # Read megatron's state only if something already imported it: importing megatron-core costs
    # seconds and cannot have initialised anything.
    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is not None and mpu.model_parallel_is_initialized():
        return mpu.get_tensor_model_parallel_group()
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            "gather_tp_param(group=None) needs megatron's parallel state to find the "
            "tensor-parallel group, and it is not initialised; pass the group explicitly"
        )
    return None


def _is_fc1(name: str) -> bool:
    return name.split(".")[-2] == "linear_fc1"


def _check_divisible(name: str, full: Tensor, dim: int, tp_size: int, hf_config: Any) -> None:
    if name.split(".")[-2] == "linear_qkv":
        _, groups, _ = attention_dims(hf_config)
        if groups % tp_size:
            raise ValueError(
                f"{name}: {groups} query groups (num_key_value_heads) cannot be split over "
                f"{tp_size} tensor-parallel ranks; use a --tensor-model-parallel-size dividing "
                f"{groups}"
            )
    rows = full.shape[dim] // 2 if _is_fc1(name) else full.shape[dim]
    if rows % tp_size:
        raise ValueError(
            f"{name}: dim {dim} of size {rows} cannot be split over {tp_size} tensor-parallel ranks"
        )
