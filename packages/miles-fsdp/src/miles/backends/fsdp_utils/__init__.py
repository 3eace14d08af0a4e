"""miles-fsdp: the PyTorch FSDP2 training backend of miles; registers as the `fsdp` train backend.

Example, one rank of a 2-rank trainer (the Ray placement code makes one per rank)::

    from miles.backends.fsdp_utils import FSDPTrainRayActor

    actor = FSDPTrainRayActor(rank=0, world_size=2, master_addr="127.0.0.1", master_port=29500)
    start_rollout = actor.init(args, role="actor", with_ref=False)
    actor.train(start_rollout, rank_shard)
    actor.update_weights()
"""

from miles.backends.fsdp_utils.actor import FSDPTrainRayActor
from miles.backends.fsdp_utils.arguments import FSDPArgs, load_fsdp_args, validate_hybrid_shard_args
from miles.backends.fsdp_utils.checkpoint import export_hf, load_checkpoint, save_checkpoint
from miles.backends.fsdp_utils.lr_scheduler import get_lr_scheduler
from miles.backends.fsdp_utils.parallel import build_fsdp_meshes, create_fsdp_parallel_state
from miles.backends.fsdp_utils.update_weight_utils import iter_full_tensors

__all__ = [
    "FSDPArgs",
    "FSDPTrainRayActor",
    "build_fsdp_meshes",
    "create_fsdp_parallel_state",
    "export_hf",
    "get_lr_scheduler",
    "iter_full_tensors",
    "load_checkpoint",
    "load_fsdp_args",
    "save_checkpoint",
    "validate_hybrid_shard_args",
]
