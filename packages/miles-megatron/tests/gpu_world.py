"""GPU variants of the 2-process tests: the same workers over NCCL instead of gloo."""

from __future__ import annotations

import torch
import torch.distributed as dist


def join_nccl_world(rank: int, init_method: str) -> torch.device:
    """Swap run_distributed's gloo world for an NCCL one over the same ranks; this rank's GPU."""
    world = dist.get_world_size()
    dist.destroy_process_group()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world)
    return torch.device("cuda", rank)
