"""Trainer fault tolerance's bookkeeping without Ray: which rollouts a restarted group replays,
the limit of restarts and its message, and the kept train data on disk (written whole, read back,
dropped once a checkpoint covers it)."""

from __future__ import annotations

import pytest
import torch

from miles.ray.kept_train_data import KeptTrainData
from miles.ray.train_group import TrainRankError
from miles.ray.train_restarts import TrainRestarts, TrainRestartsExhaustedError


def test_a_restart_replays_the_rollouts_trained_since_the_last_checkpoint():
    restarts = TrainRestarts(2, resume_at=0)
    for rollout_id in range(5):
        restarts.trained_rollout(rollout_id)
        if rollout_id == 2:
            restarts.checkpointed(2)
    assert (restarts.resume_at, restarts.trained) == (3, [3, 4])
    restarts.count(TrainRankError("train rank 1 of 2 (pid 7 on node x) died in train"))
    assert restarts.metrics()["train/restarts"] == 1.0


def test_failures_past_the_limit_stop_naming_the_last_one():
    restarts = TrainRestarts(1, resume_at=0)
    restarts.count(TrainRankError("rank 0 died"))
    with pytest.raises(TrainRestartsExhaustedError) as error:
        restarts.count(TrainRankError("train rank 1 of 2 (pid 9 on node y) failed in train: boom"))
    message = str(error.value)
    assert message.startswith("train ranks failed 2 times, and --max-train-restarts is 1;")
    assert "the last failure: train rank 1 of 2 (pid 9 on node y) failed in train: boom" in message
    assert "fails deterministically" in message


def test_kept_train_data_is_read_back_whole_and_dropped_through_a_checkpoint(tmp_path):
    (tmp_path / "train_data").mkdir()
    (tmp_path / "train_data" / "rollout_0000009.pt").write_text("left by an earlier process")
    kept = KeptTrainData(tmp_path)
    assert not kept.directory.exists()  # an earlier process's files are not this one's
    shards = [
        {"tokens": [[1, 2, 3]], "rewards": [0.5]},
        {"tokens": [[4]], "rewards": [torch.tensor(1.0)]},
    ]
    for rollout_id in (3, 4, 5):
        kept.keep(rollout_id, shards)
    assert kept.load(4) == shards
    kept.drop_through(4)
    assert sorted(p.name for p in kept.directory.iterdir()) == ["rollout_0000005.pt"]
    with pytest.raises(FileNotFoundError, match="the train data of rollout 4 is not at"):
        kept.load(4)
