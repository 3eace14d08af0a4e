"""Megatron's parallel state (tensor, pipeline, context, expert and data-parallel groups) built on
the torch.distributed world this process already joined, and returned as training-utils'
backend-neutral `ParallelState`.

Megatron orders ranks tp-cp-ep-dp-pp (tensor parallel innermost, so a tensor-parallel group stays
inside a node). This module creates no world: the actor (or a test) has initialised it already.
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from miles.backends.megatron_utils.arguments import MegatronArgs
from miles.backends.training_utils.infra.parallel import GroupInfo, ParallelState

logger = logging.getLogger(__name__)


def initialize_megatron_parallel(args: MegatronArgs) -> ParallelState:
    """Create Megatron's groups over the current world, seed its RNG tracker, return the state.

    Every rank must call this with the same `args` (group creation is a collective). The model
    parallel CUDA seed (`--seed`, offset per tensor-parallel rank by Megatron) must be set before
    a model is built: Megatron initialises tensor-parallel weights inside its RNG tracker.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize_megatron_parallel needs torch.distributed initialised first "
            "(dist.init_process_group on every rank); Megatron's groups are carved out of it"
        )
    if mpu.model_parallel_is_initialized():
        raise RuntimeError(
            "Megatron's parallel state is already initialised in this process; call "
            "destroy_megatron_parallel() before initialising it again"
        )
    world = dist.get_world_size()
    if world % args.model_parallel_size:
        raise ValueError(
            f"the {world} ranks must be a multiple of --tensor-model-parallel-size x "
            f"--pipeline-model-parallel-size x --context-parallel-size "
            f"({args.tensor_model_parallel_size} x {args.pipeline_model_parallel_size} x "
            f"{args.context_parallel_size} = {args.model_parallel_size}); choose sizes whose "
            f"product divides {world}"
        )
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )
    model_parallel_cuda_manual_seed(args.seed)
    state = ParallelState(
        dp=GroupInfo.from_group(mpu.get_data_parallel_group()),
        cp=GroupInfo.from_group(mpu.get_context_parallel_group()),
        tp=GroupInfo.from_group(mpu.get_tensor_model_parallel_group()),
        pp=GroupInfo.from_group(mpu.get_pipeline_model_parallel_group()),
        ep=GroupInfo.from_group(mpu.get_expert_model_parallel_group()),
        dp_cp=GroupInfo.from_group(mpu.get_data_parallel_group(with_context_parallel=True)),
    )
    logger.info(
        "Megatron parallel state: world %d = tp %d x cp %d x dp %d x pp %d (ep %d)",
        world,
        state.tp.size,
        state.cp.size,
        state.dp.size,
        state.pp.size,
        state.ep.size,
    )
    return state


def join_megatron_parallel(args: MegatronArgs) -> None:
    """Use the groups a first engine on these ranks formed (PPO's critic runs on the policy's
    ranks, with the policy's layout): Megatron's parallel state is one per process. Raises if
    there are none, or if they split the model otherwise than `args`."""
    if not mpu.model_parallel_is_initialized():
        raise RuntimeError(
            "join_megatron_parallel: Megatron's parallel state is not initialised; the policy's "
            "engine (initialize_megatron_parallel) must be built first"
        )
    found = (
        mpu.get_tensor_model_parallel_world_size(),
        mpu.get_pipeline_model_parallel_world_size(),
        mpu.get_context_parallel_world_size(),
    )
    wanted = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    if found != wanted:
        raise ValueError(
            f"this process's Megatron groups split the model tp x pp x cp = {found}, but this "
            f"engine asks for {wanted}; an engine on the policy's ranks uses the policy's "
            "--tensor-model-parallel-size, --pipeline-model-parallel-size and "
            "--context-parallel-size"
        )


def destroy_megatron_parallel() -> None:
    """Drop Megatron's groups (the world itself stays)."""
    mpu.destroy_model_parallel()
