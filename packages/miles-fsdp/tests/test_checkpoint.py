"""DCP checkpoints resume FSDP2 training exactly, in fresh processes; HF export loads in transformers.

One module-scoped run trains a tiny Qwen3 on 2 gloo ranks, saves mid-way and exports at the end;
the resume run and the single-process checks reuse its directories, to keep the suite fast.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import transformers
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)
from torch.distributed.fsdp import fully_shard

from miles.backends.fsdp_utils.checkpoint import (
    POINTER_FILE,
    export_hf,
    iteration_dir,
    latest_rollout_id,
    load_checkpoint,
    save_checkpoint,
)
from miles.backends.fsdp_utils.lr_scheduler import get_lr_scheduler
from miles.backends.fsdp_utils.parallel import build_fsdp_meshes
from miles.utils.checkpoint_layout import commit_checkpoint

from .distributed import run_distributed

TOTAL_STEPS = 5
SAVE_AFTER = 3
VOCAB = 64
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
# The single-process checks load without a process group on purpose; DCP warns about exactly that.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _tiny_config() -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )


def _build(init_seed: int, *, shard: bool = True):
    torch.manual_seed(init_seed)
    model = transformers.AutoModelForCausalLM.from_config(_tiny_config())
    if shard:
        mesh = build_fsdp_meshes("cpu", dist.get_world_size())["fsdp"]
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.98), weight_decay=0.1)
    scheduler = get_lr_scheduler(
        optimizer, decay_style="cosine", lr=1e-2, min_lr=1e-3, warmup_iters=2, decay_iters=6
    )
    return model, optimizer, scheduler


def _seed_data_rngs(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _train_step(model, optimizer, scheduler) -> float:
    # The batch depends on all three RNGs, so a resume that restores any of them wrongly
    # trains on different data and its losses diverge.
    ids = torch.randint(0, VOCAB, (2, 8))  # (B, T)
    ids = (ids + random.randrange(VOCAB) + int(np.random.randint(VOCAB))) % VOCAB
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return loss.item()


def _full_params(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in get_model_state_dict(model, options=FULL).items()}


def _train_save_export(rank: int, root: str, tokenizer_dir: str) -> dict:
    model, optimizer, scheduler = _build(init_seed=0)
    _seed_data_rngs(100 + rank)
    losses, at_save = [], {}
    for step in range(1, TOTAL_STEPS + 1):
        losses.append(_train_step(model, optimizer, scheduler))
        if step == SAVE_AFTER:
            save_checkpoint(
                f"{root}/ckpt",
                step,
                model=model,
                optimizer=optimizer,
                lr_scheduler=scheduler,
                extra_meta={"data_source": {"epoch": 0, "offset": 12}},
            )
            # Copies: with cpu_offload, CPU tensors (Adam's step) come back uncopied and would
            # keep changing with the live optimizer.
            full = get_state_dict(model, optimizer, options=FULL)
            at_save["params"], at_save["optim"] = copy.deepcopy(full)
    export_hf(
        model,
        f"{root}/hf",
        config=model.config,
        tokenizer_path=tokenizer_dir,
        dtype=torch.float32,
    )
    probe = torch.arange(16).reshape(2, 8) % VOCAB  # (B, T), the same on every rank
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    return {
        "losses": losses,
        "params": _full_params(model),
        "at_save": at_save,
        "lr": scheduler.get_last_lr(),
        "probe": probe,
        "logits": logits,
    }


def _resume(rank: int, root: str) -> dict:
    model, optimizer, scheduler = _build(init_seed=1)  # a different init: loading must replace it
    _seed_data_rngs(999)  # and different RNGs: loading must restore them
    meta = load_checkpoint(f"{root}/ckpt", model=model, optimizer=optimizer, lr_scheduler=scheduler)
    assert meta is not None, "the checkpoint written by the first run was not found"
    losses = [
        _train_step(model, optimizer, scheduler)
        for _ in range(meta["rollout_id"] + 1, TOTAL_STEPS + 1)
    ]
    return {
        "meta": meta,
        "losses": losses,
        "params": _full_params(model),
        "lr": scheduler.get_last_lr(),
    }


def _build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fsdp_ckpt")
    _build_tokenizer(root / "tokenizer")
    first = run_distributed(_train_save_export, 2, str(root), str(root / "tokenizer"))
    resumed = run_distributed(_resume, 2, str(root))
    return {"root": root, "first": first, "resumed": resumed}


def test_resume_in_fresh_processes_matches_the_uninterrupted_run(runs):
    for rank in range(2):
        first, resumed = runs["first"][rank], runs["resumed"][rank]
        assert resumed["meta"]["rollout_id"] == SAVE_AFTER
        # Same processes layout, same ops, one thread: CPU training is bit-for-bit reproducible.
        assert resumed["losses"] == first["losses"][SAVE_AFTER:], f"rank {rank}"
        assert resumed["lr"] == first["lr"]
    first_params, resumed_params = runs["first"][0]["params"], runs["resumed"][0]["params"]
    assert first_params.keys() == resumed_params.keys()
    for name, value in first_params.items():
        assert torch.equal(resumed_params[name], value), name


def test_meta_json_records_the_run_and_the_extra_state(runs):
    meta = runs["resumed"][0]["meta"]
    assert meta["world_size"] == 2
    assert meta["lr_scheduler_steps"] == SAVE_AFTER
    assert meta["extra"] == {"data_source": {"epoch": 0, "offset": 12}}
    ckpt = runs["root"] / "ckpt"
    assert latest_rollout_id(ckpt) == SAVE_AFTER
    assert sorted(p.name for p in (iteration_dir(ckpt, SAVE_AFTER) / "rng").iterdir()) == [
        "rank_0.pt",
        "rank_1.pt",
    ]


def test_a_checkpoint_without_pointer_is_not_loaded(runs, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(runs["root"] / "ckpt", copy)
    (copy / POINTER_FILE).unlink()
    model, optimizer, scheduler = _build(init_seed=5, shard=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert latest_rollout_id(copy) is None
    assert load_checkpoint(copy, model=model, optimizer=optimizer, lr_scheduler=scheduler) is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_an_interrupted_save_leaves_the_previous_checkpoint_the_latest(runs, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(runs["root"] / "ckpt", copy)
    # A crash after writing shards but before meta.json and the pointer: iteration 4 exists.
    shutil.copytree(iteration_dir(copy, SAVE_AFTER), iteration_dir(copy, SAVE_AFTER + 1))
    (iteration_dir(copy, SAVE_AFTER + 1) / "meta.json").unlink()
    model, optimizer, scheduler = _build(init_seed=5, shard=False)
    meta = load_checkpoint(copy, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    assert meta is not None and meta["rollout_id"] == SAVE_AFTER
    with pytest.raises(FileNotFoundError, match=r"iter_0000004 is incomplete"):
        load_checkpoint(copy, model=model, optimizer=None, lr_scheduler=None, rollout_id=4)


def test_a_checkpoint_of_two_ranks_loads_into_one_unsharded_process(runs):
    model, optimizer, scheduler = _build(init_seed=5, shard=False)
    load_checkpoint(runs["root"] / "ckpt", model=model, optimizer=optimizer, lr_scheduler=scheduler)
    params, optim = get_state_dict(model, optimizer)
    saved = runs["first"][0]["at_save"]
    for name, value in saved["params"].items():
        assert torch.equal(params[name], value), name
    for name, state in saved["optim"]["state"].items():
        for key, value in state.items():
            assert torch.equal(optim["state"][name][key], value), (name, key)
    assert scheduler.last_epoch == SAVE_AFTER


def test_optimizer_saved_before_its_first_step_stays_fresh(tmp_path):
    model, optimizer, scheduler = _build(init_seed=0, shard=False)
    save_checkpoint(tmp_path, 0, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    assert not optimizer.state, "saving must not initialise the optimizer state"
    fresh_model, fresh_optimizer, fresh_scheduler = _build(init_seed=1, shard=False)
    meta = load_checkpoint(
        tmp_path, model=fresh_model, optimizer=fresh_optimizer, lr_scheduler=fresh_scheduler
    )
    assert meta is not None and meta["has_optimizer"] is False
    assert not fresh_optimizer.state
    for name, value in model.state_dict().items():
        assert torch.equal(fresh_model.state_dict()[name], value), name


def test_an_uncommitted_save_is_not_the_latest_until_its_commit(tmp_path):
    # A run saves without the pointer and commits after the rollout's record is logged.
    model, optimizer, scheduler = _build(init_seed=0, shard=False)
    save_checkpoint(tmp_path, 0, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    save_checkpoint(
        tmp_path, 1, model=model, optimizer=optimizer, lr_scheduler=scheduler, commit=False
    )
    fresh, _, _ = _build(init_seed=1, shard=False)
    assert (
        load_checkpoint(tmp_path, model=fresh, optimizer=None, lr_scheduler=None)["rollout_id"] == 0
    )
    assert not torch.equal(next(fresh.parameters()), next(model.parameters()))
    commit_checkpoint(tmp_path, 1)
    assert (
        load_checkpoint(tmp_path, model=fresh, optimizer=None, lr_scheduler=None)["rollout_id"] == 1
    )
    assert torch.equal(next(fresh.parameters()), next(model.parameters()))


def test_a_pointer_that_is_not_a_number_is_an_error(tmp_path):
    (tmp_path / POINTER_FILE).write_text("latest\n")
    with pytest.raises(ValueError, match="not a rollout id"):
        latest_rollout_id(tmp_path)


def test_exported_directory_loads_in_transformers_with_the_trainers_logits(runs):
    hf_dir = runs["root"] / "hf"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    first = runs["first"][0]
    with torch.no_grad():
        logits = loaded(input_ids=first["probe"]).logits
    torch.testing.assert_close(logits, first["logits"], rtol=0, atol=1e-5)
    names = safetensors.torch.load_file(hf_dir / "model.safetensors").keys()
    assert "lm_head.weight" not in names, "tied embeddings are stored once, as in HF checkpoints"
    assert json.loads((hf_dir / "config.json").read_text())["dtype"] == "float32"
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer("w1 w2").input_ids == [1, 2]


def test_miles_export_hf_converts_a_saved_checkpoint_offline(runs, tmp_path):
    from miles.cli.main import main

    out = tmp_path / "exported"
    # The checkpoint was saved by 2 ranks; the export runs in this one process.
    status = main(
        [
            "export-hf",
            str(runs["root"] / "ckpt"),
            str(out),
            "--hf-checkpoint",
            str(runs["root"] / "hf"),
        ]
    )
    assert status == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    saved = runs["first"][0]["at_save"]["params"]
    assert set(saved) - set(loaded) <= {"lm_head.weight"}  # tied: loaded as the embedding
    for name in set(saved) & set(loaded):
        torch.testing.assert_close(loaded[name], saved[name], rtol=0, atol=0)


def test_miles_export_hf_explains_a_directory_without_checkpoint(tmp_path, capsys):
    from miles.cli.main import main

    assert main(["export-hf", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err
