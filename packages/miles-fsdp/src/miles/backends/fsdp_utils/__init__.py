"""miles-fsdp: the PyTorch FSDP2 training backend of miles; registers as the `fsdp` train backend.

Example, one rank of a 2-rank trainer (the Ray placement code makes one per rank)::

    from miles.backends.fsdp_utils import FSDPArgs, FSDPTrainRayActor

    actor = FSDPTrainRayActor(rank=0, world_size=2, master_addr="127.0.0.1", master_port=29500)
    start_rollout = actor.init(run_spec, loss_config, FSDPArgs(lr=1e-6))
    actor.train(start_rollout, rank_shard)
    actor.update_weights()

Re-exports are resolved on first use: reading the configuration imports `arguments` alone, not
the actor, torch's FSDP or the checkpoint code.
"""

import importlib
from typing import Any

_EXPORTS = {
    "FSDPArgs": "miles.backends.fsdp_utils.arguments",
    "FSDPEngine": "miles.backends.fsdp_utils.engine",
    "FSDPTrainRayActor": "miles.backends.fsdp_utils.actor",
    "build_fsdp_meshes": "miles.backends.fsdp_utils.parallel",
    "export_hf": "miles.backends.fsdp_utils.checkpoint",
    "load_checkpoint": "miles.backends.fsdp_utils.checkpoint",
    "save_checkpoint": "miles.backends.fsdp_utils.checkpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
