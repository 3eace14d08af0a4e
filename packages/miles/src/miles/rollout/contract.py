"""The rollout contract: how a run makes its samples. Implement `Rollout` to change it.

One method is required, `generate_group`: make every sample of one prompt's group. The built-in
loop (`miles.rollout.group_loop.run_groups`) calls it for each prompt of a training rollout, of an
evaluation and of the fully-async buffer, and does the rest the same way for every rollout:
concurrency, scoring, dynamic filtering, aborting leftovers, resending a group an engine lost.
`generate_rollout` (a whole rollout at once) is there to override for those that batch across
groups or need no loop at all (SFT). `SampleRollout` (`miles.rollout.sample_rollout`) is the base
for rollouts that make each sample on its own, as the tool and agent rollouts do.

`--rollout-function-path` names a subclass (built with `from_config`); `miles.rollout.loader`
adapts the functions of earlier versions to this contract.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

from miles.backends.training_utils.batching.sample import Sample
from miles.rollout.context import RolloutContext, RolloutOutput
from miles.rollout.group_loop import run_groups

if TYPE_CHECKING:
    from typing import Self

    from miles.rollout.data_source import DataSourceConfig
    from miles.rollout.rollout_config import RolloutConfig

__all__ = ["Rollout"]


class Rollout(abc.ABC):
    """How a run makes its samples. The class attributes below are its capabilities (a subclass
    sets those where it differs); the configuration's checks read them before anything starts."""

    makes_groups: ClassVar[bool] = True
    """`generate_group` makes this rollout's own groups, so fully-async generation (which runs
    group by group) can use it."""
    continues_partial_requests: ClassVar[bool] = False
    """An aborted request is continued from its tokens (--fully-async --partial-rollout)."""
    returns_routed_experts: ClassVar[bool] = False
    """Samples keep the engine's MoE routing of their tokens (--use-rollout-routing-replay)."""

    @classmethod
    def from_config(cls, config: RolloutConfig) -> Self:
        """The rollout for a run with these settings. Called wherever the rollout is loaded:
        once by the configuration's checks and once in the rollout manager."""
        del config
        return cls()

    def check(self, rollout: RolloutConfig, data: DataSourceConfig) -> None:  # noqa: B027
        """Raise a clear error, before anything starts, for settings this rollout cannot run
        with (a missing --tool-paths, ...). The default accepts everything."""

    @abc.abstractmethod
    async def generate_group(self, ctx: RolloutContext, group: list[Sample]) -> list[Sample]:
        """Make every sample of one prompt's group: `group` holds the prompt's
        --n-samples-per-prompt samples (fresh, or aborted part-way by an earlier rollout);
        return them, same length and order, each with its response tokens, `loss_mask`,
        `rollout_log_probs` and status. Scoring and filtering are the loop's, not yours."""

    async def generate_rollout(self, ctx: RolloutContext, rollout_id: int) -> RolloutOutput:
        """Make a whole training rollout: `ctx.rollout.rollout_batch_size` groups. The default
        runs the built-in loop over `generate_group`; override it to add metrics or to make the
        groups another way."""
        return await run_groups(ctx, self.generate_group, rollout_id=rollout_id)

    def for_evaluation(self) -> Rollout:
        """The rollout that makes held-out samples (`--eval-prompt-data`); by default this one,
        so a multi-turn run is evaluated over the same multi-turn exchanges."""
        return self
