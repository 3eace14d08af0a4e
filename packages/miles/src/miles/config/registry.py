"""The option registry: which group (dataclass) declares each setting of a run.

The core groups are fixed; the training backend's group comes from the backend's wheel (the class
registered under `miles.train_backend_args`; the actor is not imported), so its flags exist exactly
when that backend is chosen. Building the run's configuration from the values is `miles_config`'s.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field

from miles.backends.training_utils.algorithms.critic_config import CriticConfig
from miles.backends.training_utils.algorithms.distillation import DistillationConfig
from miles.backends.training_utils.algorithms.loss_config import LossConfig
from miles.config.eval_config import EvalConfig
from miles.config.groups import (
    CheckpointConfig,
    ClusterConfig,
    EngineConfig,
    LoggingConfig,
    TrainingConfig,
)
from miles.config.options import Option, dataclass_options
from miles.config.trainer_args import TrainerArgs
from miles.rollout.data_source import DataSourceConfig
from miles.rollout.rewards import RewardConfig
from miles.rollout.rollout_config import RolloutConfig
from miles.utils.observability.config import ObservabilityConfig
from miles.utils.plugins import TRAIN_BACKEND_ARGS, load_plugin

CORE_GROUPS: dict[str, type] = {
    "cluster": ClusterConfig,
    "engine": EngineConfig,
    "data": DataSourceConfig,
    "rollout": RolloutConfig,
    "reward": RewardConfig,
    "algorithm": LossConfig,
    "distillation": DistillationConfig,
    "critic": CriticConfig,
    "training": TrainingConfig,
    "checkpoint": CheckpointConfig,
    "eval": EvalConfig,
    "logging": LoggingConfig,
    "observability": ObservabilityConfig,
}
"""Group name -> dataclass, in the order of `--help` and the generated reference."""

BACKEND_GROUP = "backend"


def backend_config_class(train_backend: str) -> type[TrainerArgs]:
    """The settings dataclass the backend's wheel registers (a `TrainerArgs` subclass)."""
    config_class = load_plugin(TRAIN_BACKEND_ARGS, train_backend)
    if not (isinstance(config_class, type) and issubclass(config_class, TrainerArgs)):
        raise TypeError(
            f"the {TRAIN_BACKEND_ARGS} entry point {train_backend!r} names {config_class!r}, "
            "not a TrainerArgs subclass; the backend's wheel must register its settings class"
        )
    return config_class


@dataclass
class Schema:
    """Every option of a run with the groups it configures (core groups, then the backend's)."""

    groups: dict[str, type]
    options: dict[str, Option] = field(init=False)

    def __post_init__(self) -> None:
        self.options = {}
        for group, cls in self.groups.items():
            for option in dataclass_options(cls, group):
                self.options[option.name] = self._merge(option)

    def _merge(self, option: Option) -> Option:
        known = self.options.get(option.name)
        if known is None:
            return option
        # One name in two groups is one setting: it must mean the same thing in both.
        assert known.annotation == option.annotation and known.default == option.default, (
            f"{option.flag} is declared by groups {known.groups} and {option.groups} with "
            f"different types or defaults ({known.annotation}={known.default!r} vs "
            f"{option.annotation}={option.default!r}); make them agree"
        )
        return dataclasses.replace(
            known, groups=known.groups + option.groups, doc=known.doc or option.doc
        )

    @classmethod
    def for_backend(cls, train_backend: str | None) -> Schema:
        groups = dict(CORE_GROUPS)
        if train_backend:
            groups[BACKEND_GROUP] = backend_config_class(train_backend)
        return cls(groups)

    def unknown(self, name: str, where: str) -> ValueError:
        """An error for an unknown setting, suggesting the closest known one."""
        as_flag = name.startswith("--")
        known = [o.flag if as_flag else o.name for o in self.options.values()]
        key = name if as_flag else name.replace("-", "_")
        match = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"; did you mean {match[0]!r}?" if match else "; see `miles train --help`"
        return ValueError(f"unknown setting {name!r} in {where}{hint}")
