"""`TrainRunSpec`: what the loop knows that a training rank needs, as one frozen value.

Its own module, with no torch or Ray, because the driver builds it: importing the train-actor
machinery (torch) there would cost seconds before the first rollout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from miles.backends.training_utils.algorithms.critic_config import CriticConfig
    from miles.backends.training_utils.algorithms.distillation import DistillationConfig
    from miles.config.miles_config import MilesConfig


@dataclass(frozen=True, kw_only=True)
class TrainRunSpec:
    """What the loop knows that a training rank needs, besides the loss and the backend's args."""

    hf_checkpoint: str
    """The Hugging Face checkpoint the run starts from (also the tokenizer of HF exports)."""
    rollout_temperature: float
    """Sampling temperature of the engines: log-probs are taken at the same temperature."""
    global_batch_size: int
    """Samples per optimizer step, over all data-parallel replicas."""
    num_rollout: int
    """Rollouts of the whole run."""
    num_steps_per_rollout: int
    """Optimizer steps per rollout."""
    colocate: bool = False
    """Engines share the train devices (weights travel by CUDA IPC / shared memory)."""
    save: str | None = None
    """Checkpoint directory (--save)."""
    load: str | None = None
    """Directory to resume from (--load)."""
    distributed_timeout_s: float = 1800.0
    """Bound on every collective's wait (--distributed-timeout-s)."""
    engine_control_timeout_s: float = 60.0
    """Bound on an engine's answer to a pause or resume around a weight push."""
    update_weights_timeout_s: float = 1800.0
    """Bound on an engine's answer to one weight-update call (--update-weights-timeout-s)."""
    ref_load: str | None = None
    """The reference model's checkpoint (--ref-load); None: `hf_checkpoint`."""
    ref_update_interval: int | None = None
    """Copy the policy into the reference model every this many rollouts (--ref-update-interval)."""
    distillation: DistillationConfig | None = None
    """On-policy distillation (--use-opd): how the teacher KL enters the train step."""
    routing_replay: Literal["rollout", "old_policy"] | None = None
    """MoE routing replay: the engine's experts (rollout, R3: --use-rollout-routing-replay) or
    the old-policy forward's (old_policy, R2: --use-routing-replay); None: the router decides."""

    critic: CriticConfig | None = None
    """PPO's value model (--advantage-estimator ppo), with its derived directories; None
    without one."""

    @property
    def total_optimizer_steps(self) -> int:
        """Optimizer steps of the whole run (the default length of a decaying schedule)."""
        return self.num_rollout * self.num_steps_per_rollout

    @classmethod
    def from_config(cls, config: MilesConfig, *, num_rollout: int) -> TrainRunSpec:
        training = config.training
        assert training.global_batch_size and training.num_steps_per_rollout, "derived by then"
        return cls(
            hf_checkpoint=config.checkpoint.hf_checkpoint,
            rollout_temperature=config.rollout.rollout_temperature,
            global_batch_size=training.global_batch_size,
            num_rollout=num_rollout,
            num_steps_per_rollout=training.num_steps_per_rollout,
            colocate=config.cluster.colocate,
            save=config.checkpoint.save,
            load=config.checkpoint.load,
            distributed_timeout_s=training.distributed_timeout_s,
            engine_control_timeout_s=config.engine.engine_control_timeout_s,
            update_weights_timeout_s=config.engine.update_weights_timeout_s,
            ref_load=config.checkpoint.ref_load,
            ref_update_interval=config.checkpoint.ref_update_interval,
            distillation=config.distillation if config.distillation.use_opd else None,
            routing_replay=(
                "rollout" if training.use_rollout_routing_replay
                else "old_policy" if training.use_routing_replay else None
            ),
            critic=config.critic if _trains_critic(config) else None,
        )  # fmt: skip


def _trains_critic(config: MilesConfig) -> bool:
    from miles.backends.training_utils.algorithms.algorithm import Algorithm

    return Algorithm.from_config(config.algorithm).estimator.needs_critic
