"""Resumable checkpoints of the FSDP backend (torch.distributed.checkpoint) and Hugging Face export.

Layout: `<save>/iter_<N:07d>/{model,optimizer,lr_scheduler}/` (DCP, sharded, loadable at any world
size), `rng/rank_<r>.pt` and `meta.json`, plus `<save>/latest_checkpointed_iteration.txt`, written
last, naming the newest complete iteration. `save_dir` must be a filesystem every rank sees.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.optim.lr_scheduler import LRScheduler

from miles.backends.fsdp_utils.lora import has_adapters, merged_state_dict
from miles.backends.fsdp_utils.param_names import hf_parameter_name
from miles.backends.sglang_utils.vlm_checkpoint import checkpoint_names, is_vision_language
from miles.backends.training_utils.infra.device import get_device_info
from miles.utils.checkpoint_layout import (
    META_FILE,
    POINTER_FILE,
    atomic_write_text,
    checkpoint_problems,
    commit_checkpoint,
    iteration_dir,
    latest_rollout_id,
    read_meta,
)

logger = logging.getLogger(__name__)

VALUE_MODEL_KEY = "value_model"
"""meta.json's `extra` entry of a critic's checkpoint: a one-label token-classification model."""
LORA_CONFIG_KEY = "lora_config"
"""meta.json's `extra` entry of a LoRA run: the adapter_config.json of the saved adapters, which
alone the checkpoint holds (the base is the run's --hf-checkpoint)."""
FORMAT_VERSION = 1
# Hugging Face's default shard size: large models export as several files plus an index.
MAX_SHARD_BYTES = 5 * 2**30


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    # Without a process group (a single-process script or test) DCP reads and writes everything
    # itself; say so explicitly rather than rely on its guess.
    dcp.save(state, checkpoint_id=path, no_dist=not dist.is_initialized())


def _dcp_load(state: dict[str, Any], path: Path) -> None:
    """Load into `state` in place: its tensors (sharded or not) say which slices this rank wants."""
    dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())


def save_checkpoint(
    save_dir: str | os.PathLike,
    rollout_id: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: LRScheduler | None,
    extra_meta: dict | None = None,
    commit: bool = True,
    trainable_only: bool = False,
) -> Path:
    """Save everything needed to resume after `rollout_id`; every rank must call it.

    `extra_meta` (JSON-serialisable: data-source position, step counters) is stored in meta.json
    and returned by `load_checkpoint`. The pointer file moves to this iteration only after every
    rank has written its part, so a crash mid-save leaves the previous checkpoint the latest.
    `commit=False` leaves the pointer to the caller (`checkpoint_layout.commit_checkpoint`).
    `trainable_only`: the parameters that train (LoRA adapters), not the frozen ones.
    """
    if rollout_id < 0:
        raise ValueError(f"rollout_id must be >= 0, got {rollout_id}")
    extra_json = json.dumps(extra_meta or {})  # fail before writing anything, on every rank
    path = iteration_dir(save_dir, rollout_id)
    if _rank() == 0:
        if path.exists():  # a re-save must not mix in files of the earlier one
            shutil.rmtree(path)
        path.mkdir(parents=True)
    _barrier()
    # An optimizer that never stepped has no state; asking DCP for it would create it by taking a
    # zero step, which advances Adam's step count and changes every later update.
    save_optimizer = optimizer is not None and bool(optimizer.state)
    model_state, optim_state = _states(
        model, optimizer if save_optimizer else None, trainable_only=trainable_only
    )
    _dcp_save(model_state, path / "model")
    if save_optimizer:
        _dcp_save(optim_state, path / "optimizer")
    if lr_scheduler is not None:
        _dcp_save({"lr_scheduler": lr_scheduler.state_dict()}, path / "lr_scheduler")
    _save_rng(path / "rng" / f"rank_{_rank()}.pt")
    _barrier()  # every rank's files exist before rank 0 declares the checkpoint complete
    if _rank() == 0:
        meta = {
            "format_version": FORMAT_VERSION,
            "rollout_id": rollout_id,
            "world_size": _world_size(),
            "lr_scheduler_steps": None if lr_scheduler is None else lr_scheduler.last_epoch,
            "has_optimizer": save_optimizer,
            "has_lr_scheduler": lr_scheduler is not None,
            "trainable_only": trainable_only,
            "extra": json.loads(extra_json),
        }
        atomic_write_text(path / META_FILE, json.dumps(meta, indent=2))
        if commit:
            commit_checkpoint(save_dir, rollout_id)
        logger.info("saved checkpoint of rollout %d to %s", rollout_id, path)
    _barrier()  # no rank reads or prunes checkpoints before rank 0 has finished this one
    return path


def load_checkpoint(
    load_dir: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: LRScheduler | None,
    rollout_id: int | None = None,
    trainable_only: bool = False,
) -> dict | None:
    """Restore a checkpoint into the given objects and this rank's RNGs; every rank must call it.

    rollout_id None loads the iteration the pointer file names; without a pointer (nothing
    saved, or the first save crashed) it returns None and changes nothing. Returns the meta.json
    dict (rollout_id, world_size, lr_scheduler_steps, extra, ...). The world size may differ
    from the one that saved: DCP reshards the model and optimizer states.
    """
    if rollout_id is None:
        rollout_id = latest_rollout_id(load_dir)
        if rollout_id is None:
            logger.info(
                "no complete checkpoint in %s (no %s); starting fresh", load_dir, POINTER_FILE
            )
            return None
    path = iteration_dir(load_dir, rollout_id)
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(
            f"checkpoint {path} is incomplete or missing (no {META_FILE}: its save did not "
            f"finish); load an earlier iteration, or point {POINTER_FILE} at a complete one"
        )
    meta = _read_meta(path)
    if bool(meta.get("trainable_only", False)) != trainable_only:
        saved = "LoRA adapters only" if meta.get("trainable_only") else "every weight"
        raise ValueError(
            f"checkpoint {path} holds {saved}, but this run "
            f"{'trains LoRA adapters' if trainable_only else 'trains every weight'}; resume "
            "with the --lora-rank it was saved with, or start a fresh --save directory"
        )
    _load_model_and_optimizer(path, meta, model, optimizer, trainable_only=trainable_only)
    if lr_scheduler is not None:
        if not meta["has_lr_scheduler"]:
            raise ValueError(f"{path} holds no lr scheduler state; pass lr_scheduler=None")
        state = {"lr_scheduler": lr_scheduler.state_dict()}
        _dcp_load(state, path / "lr_scheduler")
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    _load_rng(path / "rng" / f"rank_{_rank()}.pt", meta["world_size"])
    logger.info("loaded checkpoint of rollout %d from %s", rollout_id, path)
    return meta


def _read_meta(path: Path) -> dict:
    return read_meta(path, f"load an earlier iteration, or point {POINTER_FILE} at a complete one")


def _load_model_and_optimizer(
    path: Path,
    meta: dict,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    trainable_only: bool,
) -> None:
    if optimizer is not None and not meta["has_optimizer"]:
        # Saved before the first optimizer step: the fresh optimizer already matches it.
        logger.info(
            "%s has no optimizer state (saved before the first step); keeping it fresh", path
        )
        optimizer = None
    # The current (possibly sharded) state dicts are the templates DCP loads into in place.
    model_state, optim_state = _states(model, optimizer, trainable_only=trainable_only)
    options = _options(trainable_only)
    _dcp_load(model_state, path / "model")
    if optimizer is None:
        set_model_state_dict(model, model_state, options=options)
        return
    _dcp_load(optim_state, path / "optimizer")
    set_state_dict(
        model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
        options=options,
    )  # fmt: skip


def _states(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, trainable_only: bool
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Model and optimizer state dicts keyed by parameter name, sharded as they live in memory."""
    options = _options(trainable_only)
    if optimizer is None:
        return get_model_state_dict(model, options=options), None
    return get_state_dict(model, optimizer, options=options)


def _options(trainable_only: bool) -> StateDictOptions:
    # Without the frozen parameters the state is partial: loading it must not ask for them.
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def _save_rng(path: Path) -> None:
    name, keys, pos, has_gauss, cached_gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        # As plain numbers and tensors, so the file loads with torch.load(weights_only=True).
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached_gauss),
        "torch_cpu": torch.get_rng_state(),
    }
    info = get_device_info()
    if info.is_accelerator:
        state["accelerator"] = torch.get_device_module(info.torch_device_type).get_rng_state()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)


def _load_rng(path: Path, saved_world_size: int) -> None:
    if not path.is_file():
        logger.warning(
            "no RNG state for rank %d in %s (saved by %d ranks); this rank's RNGs are not restored",
            _rank(),
            path.parent,
            saved_world_size,
        )
        return
    state = torch.load(path, weights_only=True)
    random.setstate(_as_tuples(state["python"]))
    name, keys, pos, has_gauss, cached_gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gauss))
    torch.set_rng_state(state["torch_cpu"])
    info = get_device_info()
    if info.is_accelerator and "accelerator" in state:
        torch.get_device_module(info.torch_device_type).set_rng_state(state["accelerator"])


def _as_tuples(value: Any) -> Any:
    """random.setstate wants tuples; a round trip through torch.save keeps them, but be lenient."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list | tuple) else value


def export_hf(
    model: torch.nn.Module,
    out_dir: str | os.PathLike,
    *,
    config: Any,
    tokenizer_path: str | None,
    dtype: torch.dtype,
) -> None:
    """Write a directory `AutoModelForCausalLM.from_pretrained(out_dir)` loads; every rank calls it.

    The full weights are gathered to rank 0's host memory and written there as safetensors in
    `dtype`, with `config` (a transformers config) and, when `tokenizer_path` is given, the
    tokenizer. Tied parameters are written once when the config ties them, as HF checkpoints do.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_state = get_model_state_dict(model, options=options)  # a collective: every rank gathers
    if _rank() == 0 and has_adapters(model):
        full_state = merged_state_dict(model, full_state)  # a LoRA policy exports merged
    if _rank() == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = _hf_tensors(
            model, full_state, dtype, tie=bool(getattr(config, "tie_word_embeddings", False))
        )
        renames = checkpoint_names(config)  # a VLM's weights as its hub checkpoint names them
        tensors = {renames.get(name, name): tensor for name, tensor in tensors.items()}
        _write_safetensors(tensors, out)
        _write_config(model, config, dtype, out)
        if tokenizer_path is not None:
            # Only export needs the tokenizer machinery; a VLM's processor holds its tokenizer.
            from transformers import AutoProcessor, AutoTokenizer

            auto = AutoProcessor if is_vision_language(config) else AutoTokenizer
            auto.from_pretrained(tokenizer_path).save_pretrained(out)
        logger.info("exported %d tensors (%s) to %s", len(tensors), dtype, out)
    _barrier()  # the directory is complete before any rank returns


def export_checkpoint_to_hf(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    hf_checkpoint: str | None = None,
    dtype: torch.dtype | None = None,
    adapter_only: bool = False,
) -> Path:
    """Offline `miles export-hf`: a saved checkpoint (a --save directory, whose latest iteration
    is used, or one `iter_*` directory) as a Hugging Face directory, in one process.

    The model is rebuilt from the config of `hf_checkpoint` (default: the one the run trained,
    recorded in meta.json) and DCP reshards the saved weights into it, whatever the world size
    that saved them. `dtype` defaults to the original checkpoint's. A LoRA run's checkpoint holds
    its adapters only: they go onto `hf_checkpoint`'s weights, and the export is the merged
    model, or with `adapter_only` the PEFT adapter directory.
    """
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForTokenClassification,
    )

    path = Path(checkpoint)
    if not (path / META_FILE).is_file():
        rollout_id = latest_rollout_id(path)
        if rollout_id is None:
            raise FileNotFoundError(
                f"{path} is neither a checkpoint (no {META_FILE}) nor a --save directory (no "
                f"{POINTER_FILE}); pass the --save directory of a run or one of its iter_* dirs"
            )
        path = iteration_dir(path, rollout_id)
    if path.name.startswith("iter_") and path.name[5:].isdigit():  # a run's: check its manifest
        if problems := checkpoint_problems(path.parent, int(path.name[5:])):
            raise ValueError(f"checkpoint {path} is damaged: {'; '.join(problems)}")
    meta = _read_meta(path)
    source = hf_checkpoint or meta.get("extra", {}).get("hf_checkpoint")
    if not source:
        raise ValueError(
            f"{path} does not record the Hugging Face checkpoint it was trained from; pass "
            "--hf-checkpoint (its config and tokenizer are copied into the export)"
        )
    config = AutoConfig.from_pretrained(source)
    lora = meta.get("extra", {}).get(LORA_CONFIG_KEY)
    if lora is None and adapter_only:
        raise ValueError(
            f"{path} holds a fully fine-tuned model, not LoRA adapters; drop --adapter-only"
        )
    if lora is not None:
        model = _merged_or_adapter(path, source, lora, out_dir, adapter_only=adapter_only)
        if model is None:
            return path
    else:
        value_model = bool(meta.get("extra", {}).get(VALUE_MODEL_KEY, False))
        if value_model:
            config.num_labels = 1
            config.classifier_dropout = 0.0  # as it trained (modeling.build_fsdp_model)
        if value_model:
            auto = AutoModelForTokenClassification
        elif is_vision_language(config):
            auto = AutoModelForImageTextToText
        else:
            auto = AutoModelForCausalLM
        model = auto.from_config(config, torch_dtype=torch.float32)
        state = get_model_state_dict(model)
        _dcp_load(state, path / "model")
        set_model_state_dict(model, state)
    export_dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(export_dtype, str):
        export_dtype = getattr(torch, export_dtype)
    export_hf(model, out_dir, config=config, tokenizer_path=source, dtype=export_dtype)
    return path


def _merged_or_adapter(
    path: Path, source: str, lora: dict[str, Any], out_dir: str | os.PathLike, *, adapter_only: bool
) -> torch.nn.Module | None:
    """A LoRA checkpoint's adapters on `source`'s weights: with `adapter_only` written to
    `out_dir` as a PEFT adapter directory (returns None), else the merged model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    config = LoraConfig.from_peft_type(**lora)
    config.inference_mode = False  # trainable while the saved state goes in
    adapted = get_peft_model(base, config)
    options = _options(trainable_only=True)
    state = get_model_state_dict(base, options=options)
    _dcp_load(state, path / "model")
    set_model_state_dict(base, state, options=options)
    if adapter_only:
        adapted.peft_config["default"].base_model_name_or_path = str(source)
        adapted.peft_config["default"].inference_mode = True
        adapted.save_pretrained(str(out_dir))
        logger.info("exported the LoRA adapter of %s to %s", path, out_dir)
        return None
    return adapted.merge_and_unload()


def _hf_tensors(
    model: torch.nn.Module, full_state: dict[str, torch.Tensor], dtype: torch.dtype, *, tie: bool
) -> dict[str, torch.Tensor]:
    """Hugging Face names -> contiguous tensors in `dtype`, tied aliases dropped (or copied)."""
    canonical: dict[int, str] = {}
    aliases: set[str] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        name = hf_parameter_name(name)
        if canonical.setdefault(id(param), name) != name:
            aliases.add(name)
    tensors = {}
    for name, tensor in full_state.items():
        name = hf_parameter_name(name)
        if name in aliases and tie:
            continue  # from_pretrained re-ties it to its source
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        # safetensors refuses tensors sharing memory, so an untied alias gets its own copy.
        tensors[name] = tensor.contiguous().clone() if name in aliases else tensor.contiguous()
    return tensors


def _write_safetensors(tensors: dict[str, torch.Tensor], out: Path) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > MAX_SHARD_BYTES:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    metadata = {"format": "pt"}  # transformers checks this marker when loading
    if len(shards) == 1:
        safetensors.torch.save_file(shards[0], out / "model.safetensors", metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        safetensors.torch.save_file(shard, out / file_name, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_config(model: torch.nn.Module, config: Any, dtype: torch.dtype, out: Path) -> None:
    config = copy.deepcopy(config)  # the trainer's config must keep its own dtype
    config.dtype = dtype
    if not getattr(config, "architectures", None):
        # fully_shard swaps the class for a subclass named FSDP<cls>; name the original class.
        cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
        config.architectures = [cls.__name__]
    config.save_pretrained(out)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(out)
