"""A checkpoint is verified before it is loaded: checkpoints written by the real save function,
then damaged as disks and crashes damage them, and handed to the run's real checkpoint selection
(`checkpoint_to_resume`) and the real loader. One process, no process group: seconds in all."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from miles.backends.fsdp_utils.checkpoint import (
    POINTER_FILE,
    export_checkpoint_to_hf,
    iteration_dir,
    latest_rollout_id,
    load_checkpoint,
    save_checkpoint,
)
from miles.utils.checkpoint_layout import MANIFEST_FILE, checkpoint_problems, commit_checkpoint
from miles.utils.run_dirs import RunDirectoryError, checkpoint_to_resume

# Saved and loaded without a process group on purpose; DCP warns about exactly that.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Checkpoints of rollouts 0 and 1 (different weights), the pointer naming 1."""
    save = tmp_path_factory.mktemp("manifest") / "save"
    for rollout_id in (0, 1):
        save_checkpoint(
            save, rollout_id, model=_model(seed=rollout_id), optimizer=None, lr_scheduler=None
        )
    return save


@pytest.fixture
def save(saved, tmp_path) -> Path:
    copy = tmp_path / "save"
    shutil.copytree(saved, copy)
    return copy


def _largest_tensor_file(save: Path, rollout_id: int) -> Path:
    return max((iteration_dir(save, rollout_id) / "model").glob("*.distcp"),
               key=lambda p: p.stat().st_size)  # fmt: skip


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_three_bits(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2  # inside the tensor bytes, not the file's header
    for offset, bit in ((0, 0), (7, 3), (301, 6)):
        data[middle + offset] ^= 1 << bit
    path.write_bytes(bytes(data))


DAMAGES = {
    "truncated shard": (lambda s: _truncate(_largest_tensor_file(s, 1)), "bytes, "),
    "missing shard": (lambda s: _largest_tensor_file(s, 1).unlink(), "is missing"),
    "empty meta.json": (lambda s: (iteration_dir(s, 1) / "meta.json").write_text(""), "bytes, "),
    "flipped bits": (lambda s: _flip_three_bits(_largest_tensor_file(s, 1)), "SHA-256"),
}


def test_a_commit_writes_a_manifest_of_every_file_last_and_an_uncommitted_save_has_none(tmp_path):
    save_checkpoint(tmp_path, 0, model=_model(0), optimizer=None, lr_scheduler=None, commit=False)
    directory = iteration_dir(tmp_path, 0)
    assert not (directory / MANIFEST_FILE).exists(), "a save not yet committed looks unfinished"
    commit_checkpoint(tmp_path, 0)
    files = json.loads((directory / MANIFEST_FILE).read_text())["files"]
    on_disk = {
        str(p.relative_to(tmp_path)) for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST_FILE
    }  # fmt: skip
    assert set(files) == on_disk and any(name.endswith(".distcp") for name in files)
    assert all(len(entry["sha256"]) == 64 and entry["bytes"] >= 0 for entry in files.values())
    assert checkpoint_problems(tmp_path, 0) == []


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_good_one_naming_the_file(
    damage, save, caplog
):
    make_damage, what = DAMAGES[damage]
    make_damage(save)
    with caplog.at_level(logging.WARNING, logger="miles.utils.run_dirs"):
        assert checkpoint_to_resume(str(save), str(save)) == 0
    warning = caplog.text
    assert f"{iteration_dir(save, 1)} is damaged" in warning and what in warning
    assert f"resuming from the newest good checkpoint, {iteration_dir(save, 0)}" in warning
    # The pointer now names rollout 0, which every reader (backends, rollout state) loads.
    assert latest_rollout_id(save) == 0
    model = _model(seed=7)
    assert load_checkpoint(save, model=model, optimizer=None, lr_scheduler=None)["rollout_id"] == 0
    for name, value in _model(seed=0).state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_an_explicit_load_of_a_damaged_checkpoint_is_an_error_naming_the_file(damage, save):
    make_damage, what = DAMAGES[damage]
    make_damage(save)
    with pytest.raises(RunDirectoryError) as error:
        checkpoint_to_resume(str(save), "/somewhere/else")
    message = str(error.value)
    assert f"--load {save}: checkpoint {iteration_dir(save, 1)} is damaged" in message
    assert what in message and POINTER_FILE in message
    assert latest_rollout_id(save) == 1, "another run's directory is left as it is"


def test_with_every_checkpoint_damaged_the_run_stops_rather_than_start_fresh(save):
    for rollout_id in (0, 1):
        _truncate(_largest_tensor_file(save, rollout_id))
    with pytest.raises(RunDirectoryError, match="holds no usable checkpoint") as error:
        checkpoint_to_resume(str(save), str(save))
    assert str(iteration_dir(save, 0)) in str(error.value)
    assert str(iteration_dir(save, 1)) in str(error.value)


def test_a_checkpoint_from_before_manifests_loads_with_a_warning(save, caplog):
    (iteration_dir(save, 1) / MANIFEST_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="miles.utils.run_dirs"):
        assert checkpoint_to_resume(str(save), str(save)) == 1
    assert "has no manifest" in caplog.text and str(iteration_dir(save, 1)) in caplog.text
    # Only its meta.json can still be checked.
    (iteration_dir(save, 1) / "meta.json").write_text("")
    with pytest.raises(RunDirectoryError, match=r"meta\.json is not valid JSON"):
        checkpoint_to_resume(str(save), None)


def test_the_loader_names_the_file_of_an_empty_meta_json(save):
    (iteration_dir(save, 1) / "meta.json").write_text("")
    with pytest.raises(ValueError, match=r"iter_0000001 is damaged: .*meta.json is not valid JSON"):
        load_checkpoint(save, model=_model(seed=7), optimizer=None, lr_scheduler=None)


def test_an_offline_export_of_a_damaged_checkpoint_is_refused_naming_the_file(save, tmp_path):
    shard = _largest_tensor_file(save, 1)
    _flip_three_bits(shard)
    with pytest.raises(ValueError, match=f"{iteration_dir(save, 1)} is damaged: {shard}"):
        export_checkpoint_to_hf(save, tmp_path / "out")
    assert not (tmp_path / "out").exists()
