"""Each rollout's train data, kept on disk from its training until a checkpoint covers it: what a
restarted train group replays to return to the state it had (architecture.md: "Trainer fault
tolerance").

Files are `<save>/train_data/rollout_<N>.pt` (the shards `save_rollout` writes), written and read
by the rollout manager, which holds torch for the train data anyway. Disk use is bounded: the
rollouts since the last checkpoint, at most --save-interval of them, plus the one in training.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

KEPT_DIR = "train_data"


class KeptTrainData:
    """The train-data files of one run's --save directory."""

    def __init__(self, save_dir: str | Path) -> None:
        self.directory = Path(save_dir) / KEPT_DIR
        # Left by an earlier process of this run: its rollouts after the checkpoint it resumes
        # from are generated again, and the run's lock says the directory is this run's.
        shutil.rmtree(self.directory, ignore_errors=True)

    def path(self, rollout_id: int) -> Path:
        return self.directory / f"rollout_{rollout_id:07d}.pt"

    def keep(self, rollout_id: int, shards: list[Any]) -> None:
        import torch  # the manager imports it for the train data anyway

        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.path(rollout_id).with_suffix(".tmp")
        torch.save({"rollout_id": rollout_id, "shards": shards}, tmp)
        tmp.replace(self.path(rollout_id))  # a file that exists is whole

    def load(self, rollout_id: int) -> list[Any]:
        from miles.ray.rollout_source import load_saved_shards

        path = self.path(rollout_id)
        if not path.is_file():
            raise FileNotFoundError(
                f"the train data of rollout {rollout_id} is not at {path}: it was removed while "
                "the run needed it to replay the rollouts since its last checkpoint"
            )
        return load_saved_shards(path)

    def drop_through(self, rollout_id: int) -> None:
        """Remove the files of rollouts up to `rollout_id` (a checkpoint now covers them)."""
        if not self.directory.is_dir():
            return
        for path in self.directory.glob("rollout_*.pt"):
            if int(path.stem.removeprefix("rollout_")) <= rollout_id:
                path.unlink(missing_ok=True)
