"""Resumable checkpoints of the Megatron backend: Megatron distributed checkpoints + miles's layout.

`<save>/iter_<N:07d>/dist/` holds model and optimizer as a Megatron distributed checkpoint (the
optimizer bucket by bucket: resume with the same tensor / pipeline layout), `rank_<r>.pt` the
scheduler, Adam's step count and this rank's RNG states, `meta.json` the rollout id and counters; the `latest` pointer (core's checkpoint_layout) is
written last, by rank 0, after every rank finished.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from miles.utils.checkpoint_layout import (
    META_FILE,
    POINTER_FILE,
    atomic_write_text,
    commit_checkpoint,
    iteration_dir,
    latest_rollout_id,
    read_meta,
)

# The distributed optimizer's layout in the checkpoint: each rank writes its own buckets, in
# parallel (Megatron-LM's default). Megatron-core's fallback, fully_sharded_model_space, can no
# longer be saved (it relies on flattened ranges), and fully_reshardable cannot be loaded into
# torch's AdamW (its loader drops the `step` state the optimizer then asks for).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def save(
    save_dir: str,
    rollout_id: int,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    *,
    extra: dict,
    commit: bool = True,
) -> Path:
    """Save everything needed to resume after `rollout_id`; every rank must call it. The pointer
    names it the latest only after every rank's part is written; `commit=False` leaves the
    pointer to the caller (`checkpoint_layout.commit_checkpoint`)."""
    path = iteration_dir(save_dir, rollout_id)
    if _rank() == 0:
        if path.exists():  # a re-save must not mix in files of the earlier one
            shutil.rmtree(path)
        (path / "dist").mkdir(parents=True)
    _barrier()
    # An optimizer that never stepped (the policy during --num-critic-only-steps) has no state,
    # and Megatron's distributed optimizer cannot describe that; zero moments at step 0 are
    # what Adam's first step would create.
    _initialize_optimizer_state(optimizer)
    model_state = model.module.sharded_state_dict()
    state = {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, metadata=OPTIMIZER_METADATA),
    }
    dist_checkpointing.save(state, str(path / "dist"))
    local = {
        "scheduler": scheduler.state_dict(),
        "rng": _rng_state(),
        "adam": _adam_steps(optimizer),
    }
    torch.save(local, path / f"rank_{_rank()}.pt")
    _barrier()  # every rank's part exists before rank 0 declares the checkpoint complete
    if _rank() == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        meta = {"rollout_id": rollout_id, "world_size": world, **extra}
        atomic_write_text(path / META_FILE, json.dumps(meta, indent=2))
        if commit:
            commit_checkpoint(save_dir, rollout_id)
    _barrier()
    return path


def load(load_dir: str, model: Any, optimizer: Any, scheduler: Any) -> dict | None:
    """Restore the latest complete checkpoint in `load_dir`; None (nothing changed) without one."""
    rollout_id = latest_rollout_id(load_dir)
    if rollout_id is None:
        return None
    path = iteration_dir(load_dir, rollout_id)
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(
            f"checkpoint {path} is incomplete (no {META_FILE}); point {POINTER_FILE} at a "
            "complete iteration"
        )
    meta = read_meta(path, f"point {POINTER_FILE} at a complete iteration")
    _initialize_optimizer_state(optimizer)
    model_state = model.module.sharded_state_dict()
    template = {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(
            model_state, is_loading=True, metadata=OPTIMIZER_METADATA
        ),
    }
    state = dist_checkpointing.load(template, str(path / "dist"))
    # With float32 parameters the distributed optimizer's master weights are views of them:
    # copying into those views must not be recorded by autograd.
    with torch.no_grad():
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    own = path / f"rank_{_rank()}.pt"
    if own.is_file() and meta["world_size"] == (
        dist.get_world_size() if dist.is_initialized() else 1
    ):
        local = torch.load(own, weights_only=False)
        scheduler.load_state_dict(local["scheduler"])
        _set_rng_state(local["rng"])
        _set_adam_steps(optimizer, local["adam"])
    return meta


def _torch_adams(optimizer: Any) -> list:
    """The torch Adam/AdamW inside each part of a Megatron optimizer (None where it is another,
    e.g. Transformer Engine's FusedAdam, which keeps its step in the param groups)."""
    inners = [
        getattr(p, "optimizer", None) for p in getattr(optimizer, "chained_optimizers", [optimizer])
    ]
    return [i if isinstance(i, torch.optim.Adam | torch.optim.AdamW) else None for i in inners]


def _adam_steps(optimizer: Any) -> list[float | None]:
    steps = []
    for inner in _torch_adams(optimizer):
        found = {float(s["step"]) for s in inner.state.values() if "step" in s} if inner else set()
        steps.append(found.pop() if len(found) == 1 else None)
    return steps


def _set_adam_steps(optimizer: Any, steps: list[float | None]) -> None:
    """Megatron's bucket-wise optimizer loader restores torch Adam's moments but not its step
    count (the bias correction): put back the saved one."""
    for inner, step in zip(_torch_adams(optimizer), steps, strict=True):
        if inner is None or step is None:
            continue
        for state in inner.state.values():
            state["step"] = torch.tensor(step, dtype=torch.float32)


def _initialize_optimizer_state(optimizer: Any) -> None:
    """Give a fresh optimizer the state entries a checkpoint will overwrite (or, saving, the
    ones Adam's first step would create); entries already there are kept.

    Without Apex or Transformer Engine, Megatron's distributed optimizer wraps torch's AdamW and,
    while building the state dict to load into, reads a `step` from every parameter's state; an
    optimizer that never stepped has none (Megatron's own init_state_fn makes only the moments).
    """
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    for part, inner in zip(parts, _torch_adams(optimizer), strict=True):
        if inner is None:
            continue
        if getattr(part, "init_state_fn", None) is not None:
            part.init_state_fn(inner, part.config)
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param].setdefault("step", torch.zeros((), dtype=torch.float32))
