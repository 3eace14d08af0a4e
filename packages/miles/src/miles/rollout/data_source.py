"""Serves prompts to rollouts: seeded epochs, a partial-rollout buffer, and resumable state.

The order is a pure function of (--rollout-seed, epoch, dataset size), so a run resumed from
`state_dict` continues with exactly the prompts, groups and indices the uninterrupted run would
have seen (architecture.md: "Contracts / Checkpoints"). Reading and rendering the file is
`PromptDataset`'s job.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
from collections import deque
from pathlib import Path
from typing import Any

from miles.backends.training_utils.batching.sample import Sample
from miles.rollout._prompt_dataset import DataSourceConfig, PromptDataset, PromptRecord

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


class RolloutDataSource:
    """Hands out groups of fresh samples, one group per prompt, epoch after epoch.

    Each epoch serves every prompt exactly once, in a permutation seeded with
    `rollout_seed + epoch`; a request that crosses the end of the dataset continues into the next
    epoch. Groups given back with `add_samples` (partial rollouts) are served first, as they are.
    `group_index` and `index` count up over the whole run, so they stay unique across rollouts.
    """

    def __init__(
        self, dataset: PromptDataset, config: DataSourceConfig, *, n_samples_per_prompt: int
    ) -> None:
        """`n_samples_per_prompt`: the size of each group, the rollout's --n-samples-per-prompt."""
        if n_samples_per_prompt < 1:
            raise ValueError(f"--n-samples-per-prompt ({n_samples_per_prompt}) must be at least 1")
        if len(dataset) == 0:
            raise ValueError(f"--prompt-data {config.prompt_data} holds no prompts to serve")
        self._dataset = dataset
        self._config = config
        self._n_samples_per_prompt = n_samples_per_prompt
        self._epoch = 0
        self._position = 0
        self._next_group_index = 0
        self._next_sample_index = 0
        self._buffer: deque[list[Sample]] = deque()
        self._order = self._permutation(0)

    @property
    def epoch(self) -> int:
        """The epoch being served, from 0; it advances when a prompt past the end is requested."""
        return self._epoch

    @property
    def epoch_position(self) -> int:
        """How many prompts of the current epoch have been served (buffered groups not counted)."""
        return self._position

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

    def _next_prompt(self) -> PromptRecord:
        if self._position == len(self._order):
            self._epoch += 1
            self._position = 0
            self._order = self._permutation(self._epoch)
            logger.info("data source: starting epoch %d", self._epoch)
        record = self._dataset[self._order[self._position]]
        self._position += 1
        return record

    def _new_group(self, record: PromptRecord) -> list[Sample]:
        group_index = self._next_group_index
        self._next_group_index += 1
        group = []
        metadata = record.metadata
        if record.tools is not None:  # --tool-key: what this row's rollout may call
            metadata = {**metadata, "tools": record.tools}
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
                )
            )
            self._next_sample_index += 1
        return group

    def _permutation(self, epoch: int) -> list[int]:
        n = len(self._dataset)
        if not self._config.rollout_shuffle:
            return list(range(n))
        import torch  # here, not at the top: the configuration imports this module

        # A fresh CPU generator per epoch: the order depends on nothing but the seed and epoch.
        generator = torch.Generator().manual_seed(self._config.rollout_seed + epoch)
        return torch.randperm(n, generator=generator).tolist()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the same sequence; JSON-serialisable."""
        return {
            "format": _STATE_FORMAT,
            "epoch": self._epoch,
            "epoch_position": self._position,
            "seed": self._config.rollout_seed,
            "shuffle": self._config.rollout_shuffle,
            "dataset_size": len(self._dataset),
            "next_group_index": self._next_group_index,
            "next_sample_index": self._next_sample_index,
            "buffer": [[sample_to_dict(s) for s in group] for group in self._buffer],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; refuses state made from other data or another order."""
        _check_state(state, self._config, len(self._dataset))
        buffer = deque([sample_from_dict(s) for s in group] for group in state["buffer"])
        self._epoch = state["epoch"]
        self._position = state["epoch_position"]
        self._next_group_index = state["next_group_index"]
        self._next_sample_index = state["next_sample_index"]
        self._buffer = buffer
        self._order = self._permutation(self._epoch)

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


def _check_state(state: dict[str, Any], config: DataSourceConfig, dataset_size: int) -> None:
    """Validate `state` against this run before anything is changed, so a refusal is harmless."""
    missing = [key for key in _STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"data source state is missing {missing}; it was not made by state_dict")
    if state["format"] != _STATE_FORMAT:
        raise ValueError(
            f"data source state has format {state['format']}, this version reads {_STATE_FORMAT}"
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
