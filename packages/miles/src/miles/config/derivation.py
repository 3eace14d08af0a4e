"""Settings derived from others: each a pure function of the groups it reads, returning the value.

`MilesConfig` writes them into the config when it is built, before the checks across groups (which
read them), and nowhere else. The run length from --num-epoch needs the dataset's size, so it is
derived later (`MilesConfig.resolve_num_rollout`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from miles.backends.training_utils.algorithms.critic_config import CRITIC_SUBDIR

if TYPE_CHECKING:
    from miles.backends.training_utils.algorithms.critic_config import CriticConfig
    from miles.config.groups import CheckpointConfig, ClusterConfig, TrainingConfig
    from miles.rollout.rollout_config import RolloutConfig


def batch_identity(rollout: RolloutConfig, training: TrainingConfig) -> tuple[int, int]:
    """(--global-batch-size, --num-steps-per-rollout) such that
    rollout_batch_size * n_samples_per_prompt == global_batch_size * num_steps_per_rollout
    (architecture.md: "Contracts / Data"); the missing side is derived, a given pair must agree."""
    samples = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    where = (
        f"--rollout-batch-size ({rollout.rollout_batch_size}) x --n-samples-per-prompt "
        f"({rollout.n_samples_per_prompt}) = {samples} samples per rollout"
    )
    gbs, steps = training.global_batch_size, training.num_steps_per_rollout
    if gbs is None and steps is None:
        steps = 1
    if gbs is None:
        assert steps is not None
        if samples % steps:
            raise ValueError(
                f"{where} cannot be split into --num-steps-per-rollout ({steps}) equal steps; "
                f"use a divisor of {samples}"
            )
        gbs = samples // steps
    elif steps is None:
        if samples % gbs:
            raise ValueError(
                f"{where} is not a multiple of --global-batch-size ({gbs}); use a divisor of "
                f"{samples}"
            )
        steps = samples // gbs
    elif gbs * steps != samples:
        raise ValueError(
            f"{where}, but --global-batch-size ({gbs}) x --num-steps-per-rollout ({steps}) = "
            f"{gbs * steps}; give only one of the two and miles derives the other"
        )
    return gbs, steps


def rollout_num_gpus(cluster: ClusterConfig) -> int | None:
    """--rollout-num-gpus; default: the train devices with --colocate, else one engine's; none
    with --rollout-external-engine-addrs (the run reserves no devices for those engines)."""
    if cluster.rollout_external_engine_addrs:
        return None
    if cluster.rollout_num_gpus is not None:
        return cluster.rollout_num_gpus
    return cluster.actor_world_size if cluster.colocate else cluster.rollout_num_gpus_per_engine


def fully_async_buffer_groups(training: TrainingConfig, rollout: RolloutConfig) -> int | None:
    """--fully-async-buffer-groups; default with --fully-async: --max-weight-staleness (at least
    one) batches of --rollout-batch-size groups."""
    if not training.fully_async or training.fully_async_buffer_groups is not None:
        return training.fully_async_buffer_groups
    # While a step trains on version v, groups generated now are trained at v + 1 at the
    # earliest: the next `staleness` batches are all the bound lets the trainer take.
    staleness = max(1, training.max_weight_staleness)
    return staleness * rollout.rollout_batch_size


def return_routed_experts(training: TrainingConfig, rollout: RolloutConfig) -> bool:
    """--return-routed-experts, also on with --use-rollout-routing-replay (R3), which trains with
    the experts the engines report."""
    return rollout.return_routed_experts or training.use_rollout_routing_replay


def critic_save_dir(
    critic: CriticConfig, checkpoint: CheckpointConfig, *, trains_critic: bool
) -> str | None:
    """--critic-save; default, when a critic trains: <--save>/critic."""
    if trains_critic and critic.critic_save is None and checkpoint.save:
        return str(Path(checkpoint.save) / CRITIC_SUBDIR)
    return critic.critic_save


def load_dir(checkpoint: CheckpointConfig) -> str | None:
    """--load; default: --save."""
    if checkpoint.load is None and checkpoint.save:
        # Resuming from --save is what a restarted run wants; a fresh --save dir has no
        # checkpoint and the run starts at rollout 0.
        return checkpoint.save
    return checkpoint.load
