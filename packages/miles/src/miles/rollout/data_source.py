"""Serves prompts to rollouts: seeded epochs, a partial-rollout buffer, and resumable state.

The order is a pure function of (--rollout-seed, epoch, dataset size), so a run resumed from
`state_dict` continues with exactly the prompts, groups and indices the uninterrupted run would
have seen (architecture.md: "Contracts / Checkpoints"). Reading and rendering the file is
`PromptDataset`'s job. A mixture (`miles.rollout.mixture`) keeps one such order per source and
draws the source of each fresh prompt by weight, seeded by the prompt's number in the run.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.backends.training_utils.batching.sample import Sample
from miles.rollout._prompt_dataset import DataSourceConfig, PromptDataset, PromptRecord
from miles.rollout.mixture import SOURCE_KEY, MixtureSource
from miles.rollout.rewards.sample_reward import names_own_reward

__all__ = [
    "DataSourceConfig",
    "PromptDataset",
    "PromptRecord",
    "RolloutDataSource",
    "num_rollouts_for_epochs",
]

logger = logging.getLogger(__name__)

# Bumped when the layout of `state_dict` changes, so an old checkpoint fails loudly, not subtly.
_STATE_FORMAT = 1
_MIXTURE_STATE_FORMAT = 2  # a mixture's state: one cursor per source, and the draws so far
_STATE_KEYS = (
    "format",
    "epoch",
    "epoch_position",
    "seed",
    "shuffle",
    "dataset_size",
    "next_group_index",
    "next_sample_index",
    "buffer",
)


@dataclass
class _Cursor:
    """Where one prompt file's epochs stand."""

    dataset: PromptDataset
    epoch: int = 0
    position: int = 0
    order: list[int] = field(default_factory=list)


class RolloutDataSource:
    """Hands out groups of fresh samples, one group per prompt, epoch after epoch.

    Each epoch serves every prompt exactly once, in a permutation seeded with
    `rollout_seed + epoch`; a request that crosses the end of the dataset continues into the next
    epoch. Groups given back with `add_samples` (partial rollouts) are served first, as they are.
    `group_index` and `index` count up over the whole run, so they stay unique across rollouts.
    """

    def __init__(
        self,
        dataset: PromptDataset,
        config: DataSourceConfig,
        *,
        n_samples_per_prompt: int,
        mixture: list[tuple[MixtureSource, PromptDataset]] | None = None,
    ) -> None:
        """`n_samples_per_prompt`: the size of each group, the rollout's --n-samples-per-prompt.
        `mixture`: the sources of a mixture file with their datasets, served instead of
        `dataset` (which is then the first source's)."""
        if n_samples_per_prompt < 1:
            raise ValueError(f"--n-samples-per-prompt ({n_samples_per_prompt}) must be at least 1")
        for source, data in mixture or [(None, dataset)]:
            if len(data) == 0:
                path = config.prompt_data if source is None else f"{config.prompt_data} source "
                raise ValueError(
                    f"--prompt-data {path}{'' if source is None else repr(source.name)} holds no "
                    "prompts to serve"
                )
        self._config = config
        self._n_samples_per_prompt = n_samples_per_prompt
        self._sources = [source for source, _ in mixture] if mixture else None
        self._cursors = [_Cursor(data) for _, data in mixture or [(None, dataset)]]
        for index, cursor in enumerate(self._cursors):
            cursor.order = self._permutation(index, 0)
        self._draws = 0
        """Fresh prompts served so far: the mixture's draw of a prompt's source is seeded by it."""
        self._next_group_index = 0
        self._next_sample_index = 0
        self._buffer: deque[list[Sample]] = deque()

    @property
    def epoch(self) -> int:
        """The epoch being served, from 0; it advances when a prompt past the end is requested.
        A mixture's: its least advanced source's."""
        return min(cursor.epoch for cursor in self._cursors)

    @property
    def epoch_position(self) -> int:
        """How many prompts of the current epoch have been served (buffered groups not counted);
        one prompt file's only."""
        return self._cursors[0].position

    def get_samples(self, num_prompts: int) -> list[list[Sample]]:
        """`num_prompts` groups: buffered ones first (oldest first), then fresh prompts."""
        if num_prompts < 0:
            raise ValueError(f"num_prompts ({num_prompts}) must be >= 0")
        groups: list[list[Sample]] = []
        while self._buffer and len(groups) < num_prompts:
            groups.append(self._buffer.popleft())
        while len(groups) < num_prompts:
            groups.append(self._new_group(self._next_prompt()))
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Give back groups (e.g. aborted partial rollouts) to be served first by `get_samples`."""
        for group in groups:
            if not (
                isinstance(group, list) and group and all(isinstance(s, Sample) for s in group)
            ):
                raise TypeError(
                    "add_samples takes a list of groups, each a non-empty list of Sample; got a "
                    f"group {_describe_group(group)}"
                )
        self._buffer.extend(groups)

    def _next_prompt(self) -> tuple[PromptRecord, MixtureSource | None]:
        index = self._draw_source()
        self._draws += 1
        cursor = self._cursors[index]
        if cursor.position == len(cursor.order):
            cursor.epoch += 1
            cursor.position = 0
            cursor.order = self._permutation(index, cursor.epoch)
            name = "" if self._sources is None else f" of source {self._sources[index].name!r}"
            logger.info("data source: starting epoch %d%s", cursor.epoch, name)
        record = cursor.dataset[cursor.order[cursor.position]]
        cursor.position += 1
        return record, None if self._sources is None else self._sources[index]

    def _draw_source(self) -> int:
        """The source of the next fresh prompt: by weight, from a generator seeded by the
        seed and the number of prompts drawn before, so a resumed run draws the same."""
        if self._sources is None:
            return 0
        point = random.Random(f"{self._config.rollout_seed}/{self._draws}").random()
        total = sum(source.weight for source in self._sources)
        cumulative = 0.0
        for index, source in enumerate(self._sources):
            cumulative += source.weight / total
            if point < cumulative:
                return index
        return len(self._sources) - 1  # the float sum fell a hair short of 1

    def _new_group(self, drawn: tuple[PromptRecord, MixtureSource | None]) -> list[Sample]:
        record, source = drawn
        group_index = self._next_group_index
        self._next_group_index += 1
        group = []
        metadata = record.metadata
        if record.tools is not None:  # --tool-key: what this row's rollout may call
            metadata = {**metadata, "tools": record.tools}
        if source is not None:  # its name for per-source metrics; its reward if the row has none
            reward = {} if names_own_reward(metadata) else source.reward
            metadata = {**metadata, **reward, SOURCE_KEY: source.name}
        for _ in range(self._n_samples_per_prompt):
            group.append(
                Sample(
                    index=self._next_sample_index,
                    group_index=group_index,
                    prompt=record.prompt,
                    tokens=list(record.prompt_ids),
                    response_length=0,
                    label=record.label,
                    metadata=copy.deepcopy(metadata),
                    messages=copy.deepcopy(record.messages),
                    images=list(record.images) or None,
                )
            )
            self._next_sample_index += 1
        return group

    def _permutation(self, source: int, epoch: int) -> list[int]:
        n = len(self._cursors[source].dataset)
        if not self._config.rollout_shuffle:
            return list(range(n))
        import torch  # here, not at the top: the configuration imports this module

        # A fresh CPU generator per epoch: the order depends on nothing but the seed and epoch.
        generator = torch.Generator().manual_seed(self._config.rollout_seed + epoch)
        return torch.randperm(n, generator=generator).tolist()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the same sequence; JSON-serialisable."""
        first = self._cursors[0]
        state: dict[str, Any] = {
            "format": _STATE_FORMAT,
            "epoch": first.epoch,
            "epoch_position": first.position,
            "seed": self._config.rollout_seed,
            "shuffle": self._config.rollout_shuffle,
            "dataset_size": len(first.dataset),
            "next_group_index": self._next_group_index,
            "next_sample_index": self._next_sample_index,
            "buffer": [[sample_to_dict(s) for s in group] for group in self._buffer],
        }
        if self._sources is not None:
            state["format"] = _MIXTURE_STATE_FORMAT
            state["draws"] = self._draws
            state["mixture"] = [
                {"name": source.name, "dataset_size": len(cursor.dataset), "epoch": cursor.epoch,
                 "epoch_position": cursor.position}
                for source, cursor in zip(self._sources, self._cursors, strict=True)
            ]  # fmt: skip
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; refuses state made from other data or another order."""
        first = self._cursors[0]
        _check_state(state, self._config, len(first.dataset), mixture=self._mixture_sizes())
        buffer = deque([sample_from_dict(s) for s in group] for group in state["buffer"])
        places = state.get("mixture") or [state]
        for index, (cursor, place) in enumerate(zip(self._cursors, places, strict=True)):
            cursor.epoch, cursor.position = place["epoch"], place["epoch_position"]
            cursor.order = self._permutation(index, cursor.epoch)
        self._draws = state.get("draws", 0)
        self._next_group_index = state["next_group_index"]
        self._next_sample_index = state["next_sample_index"]
        self._buffer = buffer

    def _mixture_sizes(self) -> dict[str, int] | None:
        if self._sources is None:
            return None
        return {s.name: len(c.dataset) for s, c in zip(self._sources, self._cursors, strict=True)}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write `state_dict` as JSON; a crash mid-write leaves the previous file intact."""
        path = Path(path)
        try:
            text = json.dumps(self.state_dict())
        except TypeError as err:
            raise TypeError(
                f"data source state is not JSON-serialisable ({err}); metadata of buffered "
                "samples must hold only JSON values"
            ) from err
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Read a file written by `save` and continue from it."""
        with open(path, encoding="utf-8") as f:
            self.load_state_dict(json.load(f))


def num_rollouts_for_epochs(num_epoch: int, dataset_size: int, rollout_batch_size: int) -> int:
    """How many full rollouts of `rollout_batch_size` prompts cover `num_epoch` epochs.

    The remainder (fewer prompts than one rollout) is not trained on.
    """
    if num_epoch < 1 or dataset_size < 1 or rollout_batch_size < 1:
        raise ValueError(
            f"--num-epoch ({num_epoch}), the dataset size ({dataset_size}) and "
            f"--rollout-batch-size ({rollout_batch_size}) must all be at least 1"
        )
    num_rollouts = num_epoch * dataset_size // rollout_batch_size
    if num_rollouts == 0:
        raise ValueError(
            f"--num-epoch ({num_epoch}) x {dataset_size} prompts = {num_epoch * dataset_size} "
            f"prompts, fewer than one rollout of --rollout-batch-size ({rollout_batch_size}); "
            f"lower --rollout-batch-size to at most {num_epoch * dataset_size} or raise --num-epoch"
        )
    return num_rollouts


def _describe_group(group: Any) -> str:
    if isinstance(group, list):
        return f"of {[type(s).__name__ for s in group]}"
    return f"of type {type(group).__name__}"


def sample_to_dict(sample: Sample) -> dict[str, Any]:
    """A sample as JSON values (its metadata must hold only JSON values)."""
    data = dataclasses.asdict(sample)
    data["status"] = str(sample.status.value)
    return data


def sample_from_dict(data: dict[str, Any]) -> Sample:
    """The sample `sample_to_dict` wrote."""
    return Sample(**data)


def _check_state(
    state: dict[str, Any],
    config: DataSourceConfig,
    dataset_size: int,
    *,
    mixture: dict[str, int] | None = None,
) -> None:
    """Validate `state` against this run before anything is changed, so a refusal is harmless.
    `mixture`: a mixture's sources and their sizes."""
    missing = [key for key in _STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"data source state is missing {missing}; it was not made by state_dict")
    wanted = _STATE_FORMAT if mixture is None else _MIXTURE_STATE_FORMAT
    if state["format"] != wanted:
        what = {_STATE_FORMAT: "one prompt file", _MIXTURE_STATE_FORMAT: "a mixture"}
        raise ValueError(
            f"data source state has format {state['format']} "
            f"({what.get(state['format'], 'unknown')}), this run reads {wanted} "
            f"({what[wanted]}); resume with the --prompt-data of the run that saved it"
        )
    if mixture is not None:
        saved = {place["name"]: place["dataset_size"] for place in state["mixture"]}
        if saved != mixture:
            raise ValueError(
                f"cannot resume the data source: the checkpoint was made with the mixture "
                f"sources {saved} (name: prompts), --prompt-data {config.prompt_data} now gives "
                f"{mixture}; resume with the same mixture"
            )
    if state["dataset_size"] != dataset_size:
        raise ValueError(
            f"cannot resume the data source: the checkpoint was made with {state['dataset_size']} "
            f"prompts, --prompt-data {config.prompt_data} now gives {dataset_size}; resume with "
            "the same --prompt-data and --rollout-max-prompt-len"
        )
    if state["seed"] != config.rollout_seed:
        raise ValueError(
            f"cannot resume the data source: the checkpoint was made with --rollout-seed "
            f"{state['seed']}, this run has {config.rollout_seed}; resume with the same seed"
        )
    if state["shuffle"] != config.rollout_shuffle:
        raise ValueError(
            f"cannot resume the data source: the checkpoint was made with --rollout-shuffle "
            f"{state['shuffle']}, this run has {config.rollout_shuffle}; resume with the same setting"
        )
    if not 0 <= state["epoch_position"] <= dataset_size or state["epoch"] < 0:
        raise ValueError(
            f"data source state is inconsistent: epoch {state['epoch']}, position "
            f"{state['epoch_position']} of {dataset_size} prompts"
        )
