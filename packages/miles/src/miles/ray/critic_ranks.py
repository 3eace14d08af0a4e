"""PPO's rollout step with a critic on ranks of its own (--critic-num-nodes /
--critic-num-gpus-per-node; architecture.md: "PPO and the critic").

With the critic on the policy's ranks one call trains both (`PolicyTrainer`). On ranks of its
own, the step is three calls, each on the same data-parallel shards (the critic has as many ranks
as the policy): the critic scores the rollout, the policy takes the values, computes GAE's
advantages and returns and takes its steps, and the critic trains on those returns. The values
and returns pass through the driver: a few floats per response token.
"""

from __future__ import annotations

from typing import Any

from miles.ray.train_group import RayTrainGroup


def train_policy_and_critic(
    policy: RayTrainGroup, critic: RayTrainGroup, rollout_id: int, data: list[Any]
) -> list[dict[str, float]]:
    """One rollout's steps of both models on `data` (one shard per replica); each step's
    metrics, the critic's beside the policy's (as with the critic on the policy's ranks)."""
    values = critic.per_replica(critic.on_shards("critic_values", None, data))
    answers = policy.on_shards("train_with_values", rollout_id, data, values)
    returns = policy.per_replica([step_returns for _, step_returns in answers])
    steps = answers[0][0]
    critic_steps = critic.on_shards("train_critic", rollout_id, data, values, returns)[0]
    if len(critic_steps) != len(steps):
        raise RuntimeError(
            f"rollout {rollout_id}: the critic took {len(critic_steps)} optimizer steps and the "
            f"policy {len(steps)}; both split the rollout by --global-batch-size (a bug)"
        )
    return [{**step, **critic_step} for step, critic_step in zip(steps, critic_steps, strict=True)]
