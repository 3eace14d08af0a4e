"""A training mixture: `--prompt-data mixture.yaml` names several prompt files, each with a sampling
weight, its own columns and its own reward.

```yaml
sources:
  - {name: max, path: max.jsonl, weight: 0.7}                     # the run's keys and reward
  - {name: words, path: words.jsonl, weight: 0.3, input_key: question, rm_type: f1}
```

Paths are relative to the mixture file. Which source each prompt comes from is drawn by weight,
seeded (`RolloutDataSource`), so a resumed run draws what the uninterrupted one would. A source's
reward is its rows' default: a row may still name its own (`metadata.rm_type`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles.rollout.rewards.config import RewardConfig
    from miles.rollout.rewards.sample_reward import SampleReward

MIXTURE_SUFFIXES = (".yaml", ".yml")
SOURCE_KEY = "source"
"""The `Sample.metadata` key holding the name of the source a mixture's sample came from."""
_KEY_FIELDS = ("input_key", "label_key", "metadata_key", "tool_key")
_REWARD_FIELDS = ("rm_type", "custom_rm_path", "rm_url")


@dataclass(frozen=True, kw_only=True)
class MixtureSource:
    """One prompt file of a mixture."""

    name: str
    path: str
    """Absolute path of the .jsonl, .json or .parquet file."""
    weight: float
    """Its share of the prompts drawn, relative to the other sources' weights."""
    keys: dict[str, str | None]
    """Column settings that differ from the run's (`input_key`, `label_key`, ...)."""
    reward: dict[str, str]
    """The reward of its rows that name none (`rm_type`, with `custom_rm_path` or `rm_url`);
    empty: the run's."""


def source_reward(
    source: MixtureSource, run: RewardConfig, prompt_data: str
) -> SampleReward | None:
    """The reward of `source`'s rows that name none (None: the run's); an error names the
    mixture file and the source."""
    from miles.rollout.rewards.sample_reward import sample_reward

    if not source.reward:
        return None
    try:
        return sample_reward(source.reward, run)
    except ValueError as err:
        raise ValueError(f"--prompt-data {prompt_data}, source {source.name!r}: {err}") from None


def is_mixture_file(prompt_data: str) -> bool:
    return Path(prompt_data).suffix.lower() in MIXTURE_SUFFIXES


def read_mixture(prompt_data: str, data_suffixes: tuple[str, ...]) -> list[MixtureSource]:
    """The sources of the mixture file `prompt_data`, checked: each message names the file and
    the source."""
    import yaml  # here: a run without a mixture never needs it

    path = Path(prompt_data)
    where = f"--prompt-data {prompt_data}"
    if not path.is_file():
        raise FileNotFoundError(f"{where}: no such mixture file; check the path")
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{where}: not valid YAML: {err}") from None
    if not isinstance(document, dict) or not isinstance(document.get("sources"), list):
        raise ValueError(
            f"{where}: a mixture file holds `sources:`, a list of {{name, path, weight, ...}}; "
            f"got {type(document).__name__}"
        )
    if unknown := sorted(set(document) - {"sources"}):
        raise ValueError(f"{where}: unknown top-level keys {unknown}; a mixture has `sources:`")
    sources = [_source(where, i, entry, path.parent, data_suffixes) for i, entry in
               enumerate(document["sources"])]  # fmt: skip
    if len(sources) < 2:
        raise ValueError(
            f"{where}: a mixture needs at least two sources, got {len(sources)}; for one file "
            "pass its path as --prompt-data"
        )
    names = [s.name for s in sources]
    if duplicates := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"{where}: source names must differ, {duplicates} repeat")
    return sources


def _source(
    where: str, position: int, entry: Any, root: Path, data_suffixes: tuple[str, ...]
) -> MixtureSource:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: source {position + 1} must be a mapping, got {entry!r}")
    name = entry.get("name")
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(
            f"{where}: source {position + 1} needs a `name` (a string without '/', it names the "
            f"source's metrics), got {name!r}"
        )
    where = f"{where}, source {name!r}"
    known = ("name", "path", "weight", *_KEY_FIELDS, *_REWARD_FIELDS)
    for key in entry:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{where}: unknown key {key!r}{hint}; the keys are {', '.join(known)}")
    file = entry.get("path")
    if not isinstance(file, str) or not file:
        raise ValueError(f"{where}: needs a `path` to a prompt file, got {file!r}")
    resolved = (root / file).resolve()
    if resolved.suffix.lower() not in data_suffixes:
        raise ValueError(
            f"{where}: path {file!r} must be a {', '.join(data_suffixes)} file, got suffix "
            f"{resolved.suffix or '(none)'!r}"
        )
    if not resolved.is_file():
        raise FileNotFoundError(f"{where}: path {file!r} is not a file ({resolved})")
    weight = entry.get("weight")
    if (
        isinstance(weight, bool)
        or not isinstance(weight, int | float)
        or not (math.isfinite(weight) and weight > 0)
    ):
        raise ValueError(f"{where}: `weight` must be a positive number, got {weight!r}")
    keys = {k: entry[k] for k in _KEY_FIELDS if k in entry}
    for key, value in keys.items():
        if value is not None and not (isinstance(value, str) and value):
            raise ValueError(f"{where}: {key} must be a column name or null, got {value!r}")
    if keys.get("input_key", "x") is None:
        raise ValueError(f"{where}: input_key cannot be null: it names the prompts' column")
    reward = {k: entry[k] for k in _REWARD_FIELDS if entry.get(k) is not None}
    for key, value in reward.items():
        if not isinstance(value, str):
            raise ValueError(f"{where}: {key} must be a string, got {value!r}")
    if reward and "rm_type" not in reward:
        raise ValueError(f"{where}: {sorted(reward)} need an `rm_type` beside them")
    return MixtureSource(name=name, path=str(resolved), weight=float(weight), keys=keys,
                         reward=reward)  # fmt: skip


def source_config(data: Any, source: MixtureSource) -> Any:
    """The run's data settings (a `DataSourceConfig`) for one source: its file and columns."""
    return dataclasses.replace(data, prompt_data=source.path, **source.keys)
