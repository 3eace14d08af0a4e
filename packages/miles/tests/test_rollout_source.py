"""Saved rollouts (--save-debug-rollout-data) replay with --load-debug-rollout-data: today's files
round-trip unchanged, and files from before the column renames load under today's names."""

from __future__ import annotations

import pytest
import torch

from miles.backends.training_utils.batching.rollout_data import (
    samples_to_rollout_batch,
    split_rollout_batch_by_dp,
)
from miles.backends.training_utils.batching.sample import Sample
from miles.ray import rollout_source
from miles.ray.rollout_source import ReplayedRollouts, Rollout, save_rollout


@pytest.fixture(autouse=True)
def no_object_store(monkeypatch):
    """Shards stand for their own object references: these tests need no Ray instance."""
    monkeypatch.setattr(rollout_source.ray, "put", lambda value: value)
    monkeypatch.setattr(rollout_source.ray, "get", lambda values: values)


def _shards() -> list[dict]:
    samples = [
        Sample(index=i, tokens=[1, 2, 3 + i, 4], response_length=2, reward=float(i),
               loss_mask=[1, i % 2], rollout_log_probs=[-0.5, -1.5 - i])
        for i in range(4)
    ]  # fmt: skip
    batch = samples_to_rollout_batch(samples, [0.5, -0.5, 1.5, -1.5])
    return split_rollout_batch_by_dp(batch, 2, [[0, 2], [1, 3]])


def _replay(pattern: str, dp_size: int = 2) -> list:
    source = ReplayedRollouts(pattern, dp_size=dp_size)
    return source.wait(source.start(0)).data


def test_a_saved_rollout_replays_with_the_same_columns(tmp_path):
    pattern = str(tmp_path / "r{rollout_id}.pt")
    shards = _shards()
    save_rollout(pattern, Rollout(0, shards))
    assert _replay(pattern) == shards


def test_a_rollout_saved_with_the_old_column_names_replays_under_todays(tmp_path):
    # One shard as earlier versions saved it: the loss mask under "loss_masks" and, where a shard
    # had them, the old policy's log-probs under "log_probs".
    columns = {
        "tokens": [[1, 2, 3, 4], [1, 2, 5, 4]], "response_lengths": [2, 2],
        "total_lengths": [4, 4], "rewards": [0.5, 1.5], "raw_reward": [0.0, 2.0],
        "sample_indices": [0, 2], "weight_versions": [None, None],
        "rollout_log_probs": [[-0.5, -1.5], [-0.5, -3.5]],
    }  # fmt: skip
    old_log_probs = [torch.tensor([-0.25, -1.25]), torch.tensor([-0.75, -3.25])]
    old = {**columns, "loss_masks": [[1, 0], [1, 1]], "log_probs": old_log_probs}
    torch.save({"rollout_id": 0, "shards": [old]}, tmp_path / "r0.pt")

    (replayed,) = _replay(str(tmp_path / "r{rollout_id}.pt"), dp_size=1)

    assert replayed.keys() == {*columns, "loss_mask", "old_log_probs"}
    assert {key: replayed[key] for key in columns} == columns
    assert replayed["loss_mask"] == [[1, 0], [1, 1]]
    assert all(map(torch.equal, replayed["old_log_probs"], old_log_probs))


def test_a_replay_with_another_data_parallel_size_names_both_sizes(tmp_path):
    save_rollout(str(tmp_path / "r{rollout_id}.pt"), Rollout(0, _shards()))
    with pytest.raises(ValueError, match="holds 2 data-parallel shards but this run trains 4"):
        _replay(str(tmp_path / "r{rollout_id}.pt"), dp_size=4)
