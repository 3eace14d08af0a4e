"""What `--rollout-function-path` names, as a `Rollout`: the one place a user's rollout is adapted.

The path may name a `Rollout` subclass (built with `from_config`) or instance, or a whole-rollout
function of earlier versions, `fn(rollout_id, *, pool, data_source, score_groups, config)` (sync or
async, returning a `RolloutOutput` or a list of groups), which `FunctionRollout` wraps. Anything
else is refused with what is missing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from miles.backends.training_utils.batching.sample import Sample
from miles.backends.training_utils.infra.import_path import ImportPathError, load_object
from miles.rollout.context import RolloutContext, RolloutOutput
from miles.rollout.contract import Rollout
from miles.rollout.rollout_config import ROLLOUT_FUNCTION_FLAG, RolloutConfig
from miles.rollout.single_turn import SingleTurnRollout

__all__ = ["FunctionRollout", "load_rollout"]

_GUIDE = "docs/guides/adding-a-rollout-function.md"


def load_rollout(config: RolloutConfig, *, run_config: Any = None) -> Rollout:
    """The rollout `config.rollout_function_path` names, built for `config`.

    `run_config`: the whole run config, handed to a function of the earlier signature (its
    `config=` argument) and to nothing else."""
    path = config.rollout_function_path
    target = load_object(path, ROLLOUT_FUNCTION_FLAG)
    if isinstance(target, Rollout):
        return target
    if isinstance(target, type):
        if not issubclass(target, Rollout):
            raise ImportPathError(
                f"{ROLLOUT_FUNCTION_FLAG} {path!r} names the class {target.__name__}, which is "
                "not a miles.rollout.contract.Rollout; subclass it and write generate_group "
                f"(see {_GUIDE})"
            )
        missing = sorted(getattr(target, "__abstractmethods__", ()))
        if missing:
            raise ImportPathError(
                f"{ROLLOUT_FUNCTION_FLAG} {path!r} names the Rollout {target.__name__}, which "
                f"does not define {', '.join(missing)}; write it (see {_GUIDE})"
            )
        return target.from_config(config)
    if not callable(target):
        raise ImportPathError(
            f"{ROLLOUT_FUNCTION_FLAG} {path!r} names a {type(target).__name__}; point it at a "
            f"Rollout subclass or a rollout function (see {_GUIDE})"
        )
    if hasattr(target, "sample_generator"):
        raise ImportPathError(
            f"{ROLLOUT_FUNCTION_FLAG} {path!r} carries a `sample_generator` attribute, which "
            "miles no longer reads: write the rollout as a Rollout subclass whose "
            f"generate_group makes one group (see {_GUIDE})"
        )
    return FunctionRollout(
        target, run_config=run_config, groups=SingleTurnRollout.from_config(config)
    )


class FunctionRollout(Rollout):
    """A whole-rollout function of earlier versions. It makes whole rollouts only, so fully-async
    generation refuses it; evaluation and `generate_group` use the built-in single-turn way
    (with --custom-generate-function-path, the user's per-sample function), as they always did."""

    makes_groups = False

    def __init__(self, fn: Callable[..., Any], *, run_config: Any, groups: Rollout) -> None:
        self.fn, self.run_config, self.groups = fn, run_config, groups

    async def generate_rollout(self, ctx: RolloutContext, rollout_id: int) -> RolloutOutput:
        result = self.fn(
            rollout_id, pool=ctx.pool, data_source=ctx.data_source,
            score_groups=ctx.score_groups, config=self.run_config,
        )  # fmt: skip
        if inspect.isawaitable(result):
            result = await result
        if isinstance(result, RolloutOutput):
            return result
        if isinstance(result, list):
            return RolloutOutput(groups=result, metrics={})
        raise TypeError(
            f"rollout function {getattr(self.fn, '__qualname__', self.fn)!r} returned a "
            f"{type(result).__name__}; return a RolloutOutput or a list of groups (lists of "
            "Sample)"
        )

    async def generate_group(self, ctx: RolloutContext, group: list[Sample]) -> list[Sample]:
        return await self.groups.generate_group(ctx, group)

    def for_evaluation(self) -> Rollout:
        return self.groups
