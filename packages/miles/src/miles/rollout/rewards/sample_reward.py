"""A row's own reward: `metadata["rm_type"]` (upstream's key), with `custom_rm_path` or `rm_url`
beside it where the type needs one, instead of the run's `--rm-type`.

A training mixture of math with a verifier, code with tests and chat with a reward model scores
each row by its task. The hub dispatches each sample on the reward its metadata names and falls
back to the run's (`RewardHub`); the data loader checks every row's reward when it reads the file,
so an unknown type is refused before the first rollout, naming the row (`check_row_reward`).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

from miles.backends.training_utils.infra.import_path import split_import_path
from miles.rollout.rewards.config import (
    BUILTIN_RM_TYPES,
    CUSTOM_RM_PATH_FLAG,
    RM_TYPES,
    RewardConfig,
)

SAMPLE_REWARD_KEYS = ("rm_type", "custom_rm_path", "rm_url")
"""The metadata keys a row names its reward with; `rm_type` alone selects the reward."""
_DEFAULT_RETRIES = next(
    f.default for f in dataclasses.fields(RewardConfig) if f.name == "rm_max_retries"
)


@dataclass(frozen=True)
class SampleReward:
    """The reward one sample is scored with; the run's own is `SampleReward.of_config`."""

    rm_type: str
    custom_rm_path: str | None = None
    rm_url: str | None = None

    @classmethod
    def of_config(cls, config: RewardConfig) -> SampleReward:
        return cls(config.rm_type, config.custom_rm_path, config.rm_url)

    @property
    def name(self) -> str:
        """How metrics name it (`reward/<name>/mean`): the type, or a custom reward's function
        name."""
        if self.rm_type == "custom" and self.custom_rm_path:
            return split_import_path(self.custom_rm_path, CUSTOM_RM_PATH_FLAG)[1][-1]
        return self.rm_type

    @property
    def reads_label(self) -> bool:
        """The built-in rewards compare the answer with the row's label."""
        return self.rm_type in BUILTIN_RM_TYPES

    def config(self, run: RewardConfig) -> RewardConfig:
        """The run's reward settings (timeouts, concurrency, failure score, ...) for this reward:
        its type, path and URL, and none of the type-specific settings it would refuse."""
        if self == SampleReward.of_config(run):
            return run
        builtin = self.rm_type in BUILTIN_RM_TYPES
        return dataclasses.replace(
            run,
            rm_type=self.rm_type,  # type: ignore[arg-type]  # checked in sample_reward
            custom_rm_path=self.custom_rm_path,
            rm_url=self.rm_url,
            group_rm=run.group_rm and not builtin,
            reward_key=None if builtin else run.reward_key,
            rm_max_retries=run.rm_max_retries if self.rm_type == "remote" else _DEFAULT_RETRIES,
        )


def names_own_reward(metadata: dict[str, Any]) -> bool:
    """Whether `metadata` names a reward (rightly or not)."""
    return any(metadata.get(key) is not None for key in SAMPLE_REWARD_KEYS)


def sample_reward(metadata: dict[str, Any], run: RewardConfig) -> SampleReward | None:
    """The reward `metadata` names, or None for the run's. A `custom` or `remote` row without its
    own `custom_rm_path` / `rm_url` uses the run's, where the run's reward is of that type.
    Raises ValueError saying what is wrong and how to fix it."""
    given = {key: metadata[key] for key in SAMPLE_REWARD_KEYS if metadata.get(key) is not None}
    if not given:
        return None
    rm_type = given.get("rm_type")
    if rm_type is None:
        raise ValueError(
            f'metadata names {sorted(given)} but no \'rm_type\'; add "rm_type": "custom" or '
            '"remote" beside it'
        )
    if rm_type not in RM_TYPES:
        close = difflib.get_close_matches(str(rm_type), RM_TYPES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"metadata rm_type {rm_type!r} is not a reward type{hint}; choose from "
            f"{', '.join(RM_TYPES)}"
        )
    path, url = given.get("custom_rm_path"), given.get("rm_url")
    if rm_type == "custom" and path is None and run.rm_type == "custom":
        path = run.custom_rm_path
    if rm_type == "remote" and url is None and run.rm_type == "remote":
        url = run.rm_url
    reward = SampleReward(rm_type, path, url)
    try:  # the same checks as the run's flags, e.g. a custom type without a function
        reward.config(run)
    except ValueError as err:
        raise ValueError(f"metadata {given}: {err}") from None
    return reward


def check_row_reward(location: str, metadata: dict[str, Any], run: RewardConfig) -> SampleReward:
    """The reward row `location` is scored with (its own, or the run's); an error names the row."""
    try:
        return sample_reward(metadata, run) or SampleReward.of_config(run)
    except ValueError as err:
        raise ValueError(f"{location}: {err}") from None
