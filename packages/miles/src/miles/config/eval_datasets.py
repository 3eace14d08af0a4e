"""From `--eval-prompt-data` or `--eval-config` to the run's `EvalDatasetConfig`s.

Both flags feed this one path: a `--eval-prompt-data NAME PATH` pair is a dataset that sets nothing
but its name and path. A setting a dataset leaves out is the run's (`DATASET_KEYS` names the flag
each one falls back to). Everything is checked here, when the configuration is built, before
anything starts, and every message names the dataset, the key, the value and the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.config import paths
from miles.config.eval_config import EvalConfig, EvalDatasetConfig
from miles.config.eval_config_file import read_eval_config
from miles.config.options import convert
from miles.rollout.data_source import DataSourceConfig
from miles.rollout.rewards.config import BUILTIN_RM_TYPES, RewardConfig
from miles.rollout.rollout_config import RolloutConfig


@dataclass(frozen=True)
class DatasetKey:
    """A setting an `--eval-config` dataset may give: its type, and what it is without it."""

    annotation: Any
    fallback: str


DATASET_KEYS: dict[str, DatasetKey] = {
    "input_key": DatasetKey(str, "--input-key"),
    "label_key": DatasetKey(str | None, "--label-key"),
    "metadata_key": DatasetKey(str | None, "--metadata-key"),
    "tool_key": DatasetKey(str | None, "--tool-key"),
    "multimodal_keys": DatasetKey(dict[str, str] | None, "--multimodal-keys"),
    "n_samples_per_eval_prompt": DatasetKey(int, "--n-samples-per-eval-prompt"),
    "temperature": DatasetKey(float, "--eval-temperature, else --rollout-temperature"),
    "top_p": DatasetKey(float, "--rollout-top-p"),
    "top_k": DatasetKey(int, "--rollout-top-k"),
    "max_response_len": DatasetKey(int, "--eval-max-response-len, else --rollout-max-response-len"),
    # The reward type is a string here, so that RewardConfig's own check suggests the close match.
    "rm_type": DatasetKey(str, "--rm-type; custom with custom_rm_path, remote with rm_url"),
    "custom_rm_path": DatasetKey(str | None, "--custom-rm-path (with the run's rm_type)"),
    "rm_url": DatasetKey(str | None, "--rm-url (with the run's rm_type)"),
    "reward_key": DatasetKey(str | None, "--reward-key (with the run's rm_type)"),
    "group_rm": DatasetKey(bool, "--group-rm (with the run's rm_type)"),
    "rm_max_retries": DatasetKey(int, "--rm-max-retries (with the run's rm_type)"),
    "rm_timeout_s": DatasetKey(float, "--rm-timeout-s"),
    "rm_concurrency": DatasetKey(int, "--rm-concurrency"),
    "reward_failure_score": DatasetKey(float, "--reward-failure-score"),
    "pass_at_k": DatasetKey(list[int], "1 and n_samples_per_eval_prompt"),
    "eval_interval": DatasetKey(int | None, "--eval-interval"),
}
"""Every key of an `--eval-config` dataset besides `name` and `path` (upstream's spellings)."""

_REWARD_KEYS = tuple(f.name for f in dataclasses.fields(RewardConfig))
# Settings that belong to one reward type: a dataset that picks another type starts without the
# run's (a run's --custom-rm-path means nothing to a dataset scored by exact match).
_TYPE_SPECIFIC_REWARD_KEYS = (
    "custom_rm_path",
    "rm_url",
    "group_rm",
    "reward_key",
    "rm_max_retries",
)
# The run's flags in the messages of the checks reused here, as a dataset's keys spell them.
_KEY_OF_FLAG = {
    "--prompt-data": "path",
    **{f"--{key.replace('_', '-')}": key for key in (*_REWARD_KEYS, *DATASET_KEYS)},
}


def build_eval_datasets(
    eval_: EvalConfig, *, rollout: RolloutConfig, data: DataSourceConfig, reward: RewardConfig
) -> list[EvalDatasetConfig]:
    """The run's evaluation datasets: those of --eval-config, else the --eval-prompt-data pairs.

    `data`'s paths must be resolved already: each dataset's data settings are a copy of them."""
    if eval_.eval_config is not None:
        source = f"--eval-config {eval_.eval_config}"
        entries = read_eval_config(eval_.eval_config, DATASET_KEYS)
    else:
        source = "--eval-prompt-data"
        pairs = eval_.eval_prompt_data or []
        entries = [{"name": n, "path": p} for n, p in zip(pairs[::2], pairs[1::2], strict=True)]
        names = [entry["name"] for entry in entries]
        if len(set(names)) < len(names):
            raise ValueError(
                f"--eval-prompt-data names a dataset twice ({' '.join(pairs)}); give each "
                "dataset its own name"
            )
    run = _RunDefaults(eval_, rollout, data, reward)
    return [_dataset(entry, run, f"{source}: dataset {entry['name']!r}") for entry in entries]


@dataclass(frozen=True)
class _RunDefaults:
    eval_: EvalConfig
    rollout: RolloutConfig
    data: DataSourceConfig
    reward: RewardConfig

    def value(self, key: str) -> Any:
        """The run's setting a dataset leaving out `key` gets (`DatasetKey.fallback`)."""
        eval_, rollout = self.eval_, self.rollout
        if key == "temperature":
            given = eval_.eval_temperature
            return given if given is not None else rollout.rollout_temperature
        if key == "max_response_len":
            return eval_.eval_max_response_len or rollout.rollout_max_response_len
        if key in ("top_p", "top_k"):
            return getattr(rollout, f"rollout_{key}")
        if key in ("n_samples_per_eval_prompt", "eval_interval"):
            return getattr(eval_, key)
        return getattr(self.data, key)


def _dataset(entry: dict[str, Any], run: _RunDefaults, where: str) -> EvalDatasetConfig:
    given = {
        key: convert(value, DATASET_KEYS[key].annotation, f"{where}, key {key!r}")
        for key, value in entry.items()
        if key in DATASET_KEYS
    }

    def setting(key: str) -> Any:
        return given[key] if key in given else run.value(key)

    n = setting("n_samples_per_eval_prompt")
    temperature, top_p, top_k = setting("temperature"), setting("top_p"), setting("top_k")
    max_response_len, interval = setting("max_response_len"), setting("eval_interval")
    _require(n >= 1, where, "n_samples_per_eval_prompt", n, "at least 1")
    _require(math.isfinite(temperature) and temperature >= 0, where, "temperature", temperature,
             ">= 0 (0 is greedy)")  # fmt: skip
    _require(0 < top_p <= 1, where, "top_p", top_p, "in (0, 1]")
    _require(top_k == -1 or top_k >= 1, where, "top_k", top_k, "-1 (off) or >= 1")
    _require(max_response_len >= 1, where, "max_response_len", max_response_len, "at least 1")
    _require(interval is None or interval >= 1, where, "eval_interval", interval, "at least 1")
    with _named(where):
        reward = _reward(run.reward, given)
        data = _data(run.data, entry["path"], given, where)
    if reward.rm_type in BUILTIN_RM_TYPES and data.label_key is None:
        raise ValueError(
            f"{where}: rm_type {reward.rm_type} compares answers with the label, but label_key "
            "is null; name the column holding the answers, or pick a reward that needs none"
        )
    return EvalDatasetConfig(
        name=entry["name"],
        data=data,
        n_samples_per_eval_prompt=n,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_response_len=max_response_len,
        reward=reward,
        pass_at_k=_pass_at_k(given.get("pass_at_k"), n, where),
        eval_interval=interval,
    )


def _require(ok: bool, where: str, key: str, value: Any, wanted: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {key} ({value}) must be {wanted}; fix it in the dataset")


def _pass_at_k(ks: list[int] | None, n: int, where: str) -> tuple[int, ...]:
    """The k of each pass@k; by default 1 and n, as --eval-prompt-data has always reported."""
    if ks is None:
        return tuple(sorted({1, n}))
    if not ks or len(set(ks)) < len(ks) or not all(1 <= k <= n for k in ks):
        raise ValueError(
            f"{where}: pass_at_k ({ks}) must list distinct k between 1 and "
            f"n_samples_per_eval_prompt ({n}); e.g. pass_at_k: {sorted({1, n})}"
        )
    return tuple(sorted(ks))


def _reward(run: RewardConfig, given: dict[str, Any]) -> RewardConfig:
    """The run's reward settings with the dataset's; a dataset that picks another reward type
    starts from that type's defaults for the type's own settings."""
    overrides = {key: given[key] for key in _REWARD_KEYS if key in given}
    if not overrides:
        return run
    if "rm_type" not in overrides:  # the path or URL says which type
        if overrides.get("custom_rm_path") is not None:
            overrides["rm_type"] = "custom"
        elif overrides.get("rm_url") is not None:
            overrides["rm_type"] = "remote"
    base: dict[str, Any] = {}
    if overrides.get("rm_type", run.rm_type) != run.rm_type:
        defaults = RewardConfig.__dataclass_fields__
        base = {key: defaults[key].default for key in _TYPE_SPECIFIC_REWARD_KEYS}
    return dataclasses.replace(run, **{**base, **overrides})


def _data(run: DataSourceConfig, path: Any, given: dict[str, Any], where: str) -> DataSourceConfig:
    """The run's data settings with the dataset's file and keys, served in file order."""
    path = convert(path, str, f"{where}, key 'path'")
    resolved = paths.absolute(path)
    assert resolved is not None
    if not Path(resolved).is_file():
        raise ValueError(
            f"{where}: path {path!r} is not a file (resolved against the launch directory: "
            f"{resolved}); fix the path or create the file"
        )
    keys = {
        k: given[k]
        for k in ("input_key", "label_key", "metadata_key", "tool_key", "multimodal_keys")
        if k in given
    }
    return dataclasses.replace(run, prompt_data=resolved, rollout_shuffle=False, **keys)


@contextlib.contextmanager
def _named(where: str) -> Iterator[None]:
    """Re-raise a ValueError of the reused checks (RewardConfig, DataSourceConfig) naming the
    dataset, with the run's flags in its message spelled as the dataset's keys."""
    try:
        yield
    except ValueError as err:
        message = str(err)
        if message.startswith(where):
            raise
        for flag in sorted(_KEY_OF_FLAG, key=len, reverse=True):
            message = message.replace(flag, _KEY_OF_FLAG[flag])
        raise ValueError(f"{where}: {message}") from None
