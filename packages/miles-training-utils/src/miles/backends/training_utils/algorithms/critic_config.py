"""The settings of PPO's value model (the critic), validated where they are built.

--advantage-estimator ppo trains a critic beside the policy: by default a copy of the policy's
start checkpoint with a fresh scalar value head, on the policy's ranks, trained after it in every
rollout; with --critic-num-nodes / --critic-num-gpus-per-node, on ranks of its own. No torch here: the driver reads this group with the rest of the configuration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

CRITIC_SUBDIR = "critic"
"""Where the critic's checkpoints go by default: `<--save>/critic`."""


@dataclass(kw_only=True)
class CriticConfig:
    """The value model of --advantage-estimator ppo."""

    critic_hf_checkpoint: str | None = None
    """Hugging Face checkpoint the critic starts from (its value head is new when it has none);
    default: --hf-checkpoint. It must read the policy's token ids (the same vocabulary)."""
    critic_load: str | None = None
    """Resume the critic from the latest checkpoint in this directory; default: --critic-save."""
    critic_save: str | None = None
    """Directory of the critic's resumable checkpoints; default: <--save>/critic."""
    critic_lr: float | None = None
    """The critic's peak learning rate; default: --lr. The rest of the optimizer and schedule
    settings are the policy's."""
    critic_lr_warmup_iters: int | None = None
    """Optimizer steps of the critic's linear warmup; default: --lr-warmup-iters."""
    num_critic_only_steps: int = 0
    """The first this many rollouts train the critic only: the policy waits for values that
    mean something (its weights stay as they are)."""
    critic_num_nodes: int | None = None
    """Nodes of a critic on ranks of its own (either flag puts it there; the other defaults to
    the policy's); default: the critic shares the policy's ranks and trains after it. Its ranks
    take the policy's data-parallel shards, so it needs as many ranks as the policy."""
    critic_num_gpus_per_node: int | None = None
    """Devices per node of a critic on ranks of its own (see --critic-num-nodes)."""

    def __post_init__(self) -> None:
        if self.critic_lr is not None and not self.critic_lr >= 0:
            raise ValueError(f"--critic-lr must be >= 0, got {self.critic_lr}")
        for flag, value in (
            ("--critic-lr-warmup-iters", self.critic_lr_warmup_iters),
            ("--num-critic-only-steps", self.num_critic_only_steps),
        ):
            if value is not None and value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")
        for flag, value in (
            ("--critic-num-nodes", self.critic_num_nodes),
            ("--critic-num-gpus-per-node", self.critic_num_gpus_per_node),
        ):
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(
                    f"{flag} must be a positive integer, got {value!r}; pass 1 or more, or leave "
                    "both --critic-num-nodes and --critic-num-gpus-per-node unset to run the "
                    "critic on the policy's ranks"
                )

    @property
    def on_own_ranks(self) -> bool:
        """The critic runs on ranks of its own (--critic-num-nodes / --critic-num-gpus-per-node),
        not on the policy's."""
        return self.critic_num_nodes is not None or self.critic_num_gpus_per_node is not None

    def ranks(self, actor_num_nodes: int, actor_num_gpus_per_node: int) -> tuple[int, int]:
        """(nodes, devices per node) of a critic on its own ranks; an unset flag is the
        policy's."""
        return (
            actor_num_nodes if self.critic_num_nodes is None else self.critic_num_nodes,
            actor_num_gpus_per_node
            if self.critic_num_gpus_per_node is None
            else self.critic_num_gpus_per_node,
        )

    def given(self) -> list[str]:
        """The flags set to other than their defaults."""
        return [
            "--" + f.name.replace("_", "-")
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        ]
