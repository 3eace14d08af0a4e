"""The registry of losses and advantage estimators: each declared once, with the inputs it reads.

`--loss-type` and `--advantage-estimator` pick an entry by name. The train step asks
`algorithm.Algorithm.inputs` which batch columns to compute, so a run whose loss reads no reference
log-probs never runs the reference model. A user's function given by
`--custom-loss-function-path` or `--custom-advantage-function-path` becomes the entry
`custom_loss` / `custom` and runs through exactly the code a built-in does.

Adding a built-in loss: write the function (in `loss.py`), add one `LossSpec` to `LOSSES`, add
one test (docs/guides/adding-a-loss.md).

Built-in entries name their functions by import path, resolved on first use: reading the registry
(config validation, the driver, `--help`) imports no torch. The table is the bottom of the
algorithm layer: `LossConfig` validates its names against it, so it imports nothing that names
`LossConfig`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from miles.backends.training_utils.infra.import_path import (
    ImportPathError,
    load_function,
    load_object,
    split_import_path,
)

if TYPE_CHECKING:
    from torch import Tensor

BatchInput = Literal["old_log_probs", "ref_log_probs", "rollout_log_probs", "advantages", "values"]
"""What the train step can compute for a loss, beyond what every loss gets (`log_probs` and
`entropy` of the policy being trained, `loss_mask`, `response_lengths`):

- old_log_probs: the policy's log-probs before this rollout's first optimizer step (or the
  engine's, with --use-rollout-logprobs);
- ref_log_probs: the frozen reference model's log-probs (runs a second model);
- rollout_log_probs: the engine's log-probs, recorded during generation;
- advantages: per-token advantages from the estimator (and `returns`);
- values: a critic's values (ppo).
"""
BATCH_INPUTS: frozenset[str] = frozenset(BatchInput.__args__)  # type: ignore[attr-defined]

# Losses, shapers and rules receive the run's `LossConfig`, and a loss also a `loss.LossNormalizer`.
# Both classes sit above this table (LossConfig checks its names against it): naming them here,
# even for type checking only, would make an import cycle, so they are typed Any.
LossFn = Callable[[dict[str, Any], Any, Any], "tuple[Tensor, dict[str, Tensor]]"]
"""(inputs, config: LossConfig, normalizer: LossNormalizer) -> (loss, metrics as (weighted sum,
weight) pairs); `inputs` holds (T,) tensors over the micro-batch's response tokens, samples
concatenated."""
Shaper = Callable[["Tensor", int, Any], "Tensor"]
"""(raw rewards (B,), group size, config: LossConfig) -> (B,) rewards as the estimator consumes
them."""
AdvantageFn = Callable[
    [dict[str, list], Any, "list[Tensor]", Any], "tuple[list[Tensor], list[Tensor]]"
]
"""(shard columns, config: LossConfig, per-sample float loss masks, dp group) -> (advantages,
returns), `advantages.Advantages`."""


class AlgorithmChoice(Protocol):
    """The settings that pick a loss and an estimator: those of a `LossConfig`, the only settings
    this table reads."""

    loss_type: str
    custom_loss_function_path: str | None
    advantage_estimator: str
    custom_advantage_function_path: str | None


_LOSS = "miles.backends.training_utils.algorithms.loss"
_ADV = "miles.backends.training_utils.algorithms.advantages"

CUSTOM_LOSS = "custom_loss"
CUSTOM_ESTIMATOR = "custom"
CUSTOM_LOSS_FLAG = "--custom-loss-function-path"
CUSTOM_ESTIMATOR_FLAG = "--custom-advantage-function-path"


def _check_inputs(inputs: frozenset[str], owner: str) -> None:
    unknown = set(inputs) - BATCH_INPUTS
    if unknown:
        raise ValueError(
            f"{owner} inputs {sorted(unknown)} are not batch inputs the train step computes; "
            f"choose from {sorted(BATCH_INPUTS)}"
        )


def _check_function(target: Callable | str, owner: str) -> None:
    if isinstance(target, str):
        split_import_path(target, owner)  # the syntax now; the import on first use
    elif not callable(target):
        raise TypeError(f"{owner} is a {type(target).__name__}: give a function or its import path")


def _function(target: Callable | str, owner: str) -> Callable:
    return target if callable(target) else load_function(target, owner)


@dataclass(frozen=True, kw_only=True)
class LossSpec:
    """One loss: its function (or the function's "module:name" path) and the batch inputs it
    reads."""

    fn: LossFn | str
    inputs: frozenset[str] = frozenset({"old_log_probs", "advantages"})
    """Batch inputs (`BatchInput`) the function reads; the step computes exactly these."""
    on_policy: bool = True
    """Trains on samples the engines generated, so the step-0 check compares the engine's
    log-probs with the trainer's; False for a loss on given data (sft_loss)."""

    def __post_init__(self) -> None:
        _check_inputs(self.inputs, "loss")
        _check_function(self.fn, "LossSpec.fn")

    @property
    def loss_function(self) -> LossFn:
        return _function(self.fn, "LossSpec.fn")


@dataclass(frozen=True, kw_only=True)
class EstimatorSpec:
    """One advantage estimator: its rollout-side reward shaper and its train-side rule (each a
    function or its "module:name" path)."""

    advantages: AdvantageFn | str
    shape: Shaper | str = f"{_ADV}:unshaped"
    inputs: frozenset[str] = frozenset()
    """Batch inputs the rule reads besides rewards and loss masks."""
    token_rewards: bool = False
    """Turns rewards into per-token returns, so a KL penalty folded into rewards (--kl-coef)
    reaches it."""
    discounting: bool = False
    """Reads --gamma."""
    needs_critic: bool = False

    def __post_init__(self) -> None:
        _check_inputs(self.inputs, "estimator")
        _check_function(self.advantages, "EstimatorSpec.advantages")
        _check_function(self.shape, "EstimatorSpec.shape")

    @property
    def advantage_function(self) -> AdvantageFn:
        return _function(self.advantages, "EstimatorSpec.advantages")

    @property
    def shape_function(self) -> Shaper:
        return _function(self.shape, "EstimatorSpec.shape")


LOSSES: dict[str, LossSpec] = {
    "policy_loss": LossSpec(fn=f"{_LOSS}:policy_loss"),
    "sft_loss": LossSpec(fn=f"{_LOSS}:sft_loss", inputs=frozenset(), on_policy=False),
}
"""--loss-type: the built-in losses by name (`custom_loss` comes from its flag)."""

_BROADCAST = f"{_ADV}:broadcast_reward"
ESTIMATORS: dict[str, EstimatorSpec] = {
    "grpo": EstimatorSpec(advantages=_BROADCAST, shape=f"{_ADV}:group_normalized"),
    "dr_grpo": EstimatorSpec(advantages=_BROADCAST, shape=f"{_ADV}:group_centred"),
    "gspo": EstimatorSpec(advantages=_BROADCAST, shape=f"{_ADV}:group_normalized"),
    "rloo": EstimatorSpec(advantages=_BROADCAST, shape=f"{_ADV}:leave_one_out"),
    "reinforce_plus_plus": EstimatorSpec(
        advantages=f"{_ADV}:reinforce_plus_plus", token_rewards=True, discounting=True
    ),
    "reinforce_plus_plus_baseline": EstimatorSpec(
        advantages=f"{_ADV}:reinforce_plus_plus_baseline",
        shape=f"{_ADV}:group_centred",
        token_rewards=True,
    ),
    "ppo": EstimatorSpec(
        advantages=f"{_ADV}:gae",
        inputs=frozenset({"values"}),
        token_rewards=True,
        discounting=True,
        needs_critic=True,
    ),
}
"""--advantage-estimator: the built-in estimators by name (`custom` comes from its flag)."""


def loss_names() -> tuple[str, ...]:
    return (*LOSSES, CUSTOM_LOSS)


def estimator_names() -> tuple[str, ...]:
    return (*ESTIMATORS, CUSTOM_ESTIMATOR)


def _load_custom(path: str, flag: str, spec_class: type, wrap: Callable[[Callable], Any]) -> Any:
    """The spec object `path` names, or the plain function it names wrapped into a spec with the
    default settings."""
    target = load_object(path, flag)
    if isinstance(target, spec_class):
        return target
    if not callable(target):
        raise ImportPathError(
            f"{flag} {path!r} names a {type(target).__name__}; point it at a function or a "
            f"{spec_class.__name__}"
        )
    return wrap(target)


def loss_spec(config: AlgorithmChoice) -> LossSpec:
    """The entry --loss-type names; `custom_loss` loads --custom-loss-function-path."""
    if config.loss_type != CUSTOM_LOSS:
        return LOSSES[config.loss_type]
    assert config.custom_loss_function_path, "LossConfig checks the pairing"
    return _load_custom(
        config.custom_loss_function_path, CUSTOM_LOSS_FLAG, LossSpec, lambda fn: LossSpec(fn=fn)
    )


def estimator_spec(config: AlgorithmChoice) -> EstimatorSpec:
    """The entry --advantage-estimator names; `custom` loads --custom-advantage-function-path."""
    if config.advantage_estimator != CUSTOM_ESTIMATOR:
        return ESTIMATORS[config.advantage_estimator]
    assert config.custom_advantage_function_path, "LossConfig checks the pairing"
    return _load_custom(
        config.custom_advantage_function_path,
        CUSTOM_ESTIMATOR_FLAG,
        EstimatorSpec,
        lambda fn: EstimatorSpec(advantages=fn),
    )


__all__ = [
    "BATCH_INPUTS",
    "ESTIMATORS",
    "LOSSES",
    "AlgorithmChoice",
    "EstimatorSpec",
    "ImportPathError",
    "LossSpec",
    "estimator_names",
    "estimator_spec",
    "loss_names",
    "loss_spec",
]
