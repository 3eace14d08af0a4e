"""LoRA on the FSDP policy (--lora-rank > 0), with PEFT's adapter layers (architecture.md: "LoRA").

PEFT wraps each targeted linear layer of the Hugging Face model in place (`base_layer` plus
`lora_A` / `lora_B`), before FSDP2 shards it; the model stays the transformers class, so the
forward, prompt sharing and `logits_to_keep` work as without adapters. The base is frozen: only
adapter parameters have gradients and optimizer state. The KL reference is the same model with
its adapters off (`adapters_disabled`), so no second copy of the base exists.

Engines get the policy merged (base + scaling * B @ A of the adapted layers only, the rest never
changes) or as a PEFT adapter (`adapter_weights` under PEFT's names, `adapter_config`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn

from miles.backends.fsdp_utils.param_names import hf_parameter_name
from miles.backends.fsdp_utils.update_weight_utils import full_tensor
from miles.config.lora_args import ALL_LINEAR, LoraArgs

logger = logging.getLogger(__name__)

ADAPTER = "default"
"""PEFT's name of the one adapter in the model."""
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module's name in an adapter file (`PeftModel.base_model.model`)."""
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


def lora_config(args: LoraArgs) -> LoraConfig:
    """PEFT's config of the adapters: from --lora-adapter-path's adapter_config.json when given
    (trainable), else from the flags."""
    if args.lora_adapter_path is not None:
        config = LoraConfig.from_pretrained(args.lora_adapter_path)
        config.inference_mode = False
        return config
    return LoraConfig(
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=args.target_module_names(),
        exclude_modules=args.exclude_module_names() or None,
        bias="none",
    )


def add_adapters(model: nn.Module, args: LoraArgs, *, load_weights: bool) -> nn.Module:
    """Wrap `model`'s targeted linear layers in PEFT adapter layers, in place; the base is frozen.

    `load_weights`: read --lora-adapter-path's weights (rank 0, whose state the other ranks
    receive when the model is sharded; they build the same layers on the meta device).
    Returns `model` itself, now holding the adapters (PEFT's wrapper is not kept: the forward
    stays the transformers model's).
    """
    if args.lora_adapter_path is not None and load_weights:
        wrapper = PeftModel.from_pretrained(model, args.lora_adapter_path, is_trainable=True)
    else:
        wrapper = get_peft_model(model, lora_config(args))
    adapted = wrapper.base_model.model
    assert adapted is model, "PEFT wraps the layers of the model it is given, in place"
    return model


def lora_layers(model: nn.Module) -> list[tuple[str, LoraLayer]]:
    """(module name, PEFT layer) of every adapted layer, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, LoraLayer) for m in model.modules())


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model: every adapter layer skips its adapter (PEFT's `disable_adapter`)."""
    layers = [layer for _, layer in lora_layers(model)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def merge_weight(base: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float) -> Tensor:
    """base + scaling * B @ A, computed in float32 (PEFT's `get_delta_weight` for a linear)."""
    delta = lora_b.float() @ lora_a.float()
    return base.float() + scaling * delta


def merged_weights(model: nn.Module, dtype: torch.dtype | None) -> Iterator[tuple[str, Tensor]]:
    """(Hugging Face name, full merged weight) of every adapted layer, in module order: what an
    engine serving the merged policy needs after an update, as the rest of the base is frozen.

    A collective where the model is sharded: every rank drains it."""
    for name, layer in lora_layers(model):
        base = full_tensor(layer.base_layer.weight)
        lora_a = full_tensor(layer.lora_A[ADAPTER].weight)
        lora_b = full_tensor(layer.lora_B[ADAPTER].weight)
        merged = merge_weight(base, lora_a, lora_b, layer.scaling[ADAPTER])
        yield hf_parameter_name(f"{name}.weight"), merged if dtype is None else merged.to(dtype)


def adapter_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(PEFT name, full float32 tensor) of every adapter matrix, the keys of an
    adapter_model.safetensors (`base_model.model.<module>.lora_A.weight`). A collective where
    the model is sharded: every rank drains it."""
    for name, matrix in adapter_matrices(model):
        yield name, full_tensor(matrix).float()


def adapter_matrices(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(PEFT name, parameter, possibly a shard) of every adapter matrix, in module order."""
    for name, layer in lora_layers(model):
        module = PEFT_PREFIX + hf_parameter_name(name)
        yield f"{module}.lora_A.weight", layer.lora_A[ADAPTER].weight
        yield f"{module}.lora_B.weight", layer.lora_B[ADAPTER].weight


def adapter_config(model: nn.Module, base_model: str) -> dict[str, Any]:
    """The adapter_config.json of `model`'s adapter, naming `base_model` as its base."""
    config = model.peft_config[ADAPTER].to_dict()
    config["base_model_name_or_path"] = str(base_model)
    config["inference_mode"] = True
    # JSON has no sets (PEFT's own writer turns them into lists too).
    return {key: sorted(value) if isinstance(value, set) else value
            for key, value in config.items()}  # fmt: skip


def merged_state_dict(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A full state dict of the adapted `model` (names as `model.state_dict()`) as the merged
    model's: each adapted layer's `base_layer.weight` merged and renamed `weight`, its
    `base_layer.bias` renamed `bias`, the adapter matrices dropped."""
    merged = dict(state)
    for name, layer in lora_layers(model):
        base, bias = f"{name}.base_layer.weight", f"{name}.base_layer.bias"
        lora_a = merged.pop(f"{name}.lora_A.{ADAPTER}.weight")
        lora_b = merged.pop(f"{name}.lora_B.{ADAPTER}.weight")
        weight = merged.pop(base)
        merged[f"{name}.weight"] = merge_weight(weight, lora_a, lora_b, layer.scaling[ADAPTER]).to(
            weight.dtype
        )
        if bias in merged:
            merged[f"{name}.bias"] = merged.pop(bias)
    return merged


# -- checks against the checkpoint, when the config is built -----------------------------------


def check_lora_checkpoint(args: LoraArgs, hf_checkpoint: str) -> None:
    """Refuse LoRA settings that do not fit `hf_checkpoint`'s model: target names that match no
    linear layer (the message lists those that exist), layers PEFT cannot wrap (fused MoE
    experts), and a --lora-adapter-path of another rank or base. Builds the model on the meta
    device: no weights are read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_checkpoint)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if args.lora_adapter_path is not None:
        _check_adapter_dir(args, model, hf_checkpoint)
        return
    _check_target_names(args.target_module_names(), model, "--target-modules")
    _check_target_names(args.exclude_module_names(), model, "--exclude-modules")
    _add_adapters_or_explain(
        model, args, f"--target-modules {args.target_modules}: PEFT cannot add adapters to "
        f"{hf_checkpoint}",
    )  # fmt: skip
    if not has_adapters(model):
        raise ValueError(
            f"--target-modules {args.target_modules} with --exclude-modules "
            f"{args.exclude_modules} leaves no layer of {hf_checkpoint} to adapt; its linear "
            f"layers: {', '.join(linear_layer_names(model))}"
        )


def linear_layer_names(model: nn.Module) -> list[str]:
    """The distinct last name parts of `model`'s linear layers, output head excluded (what
    --target-modules can name)."""
    head = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, nn.Linear) and m is not head})  # fmt: skip


def _check_target_names(names: list[str] | str, model: nn.Module, flag: str) -> None:
    if names == ALL_LINEAR:
        return
    modules = dict(model.named_modules())
    linear = linear_layer_names(model)
    head_names = {n for n, m in modules.items() if m is model.get_output_embeddings()}
    for target in names:
        matches = [m for n, m in modules.items() if n == target or n.endswith("." + target)]
        if any(n == target or n.endswith("." + target) for n in head_names):
            raise ValueError(
                f"{flag} {target}: the output head is not adapted (all-linear leaves it out too: "
                "a merged head would also change tied embeddings); target the decoder's layers: "
                f"{', '.join(linear)}"
            )
        if not matches:
            raise ValueError(
                f"{flag} {target} matches no module of {type(model).__name__}; its linear "
                f"layers are: {', '.join(linear)}"
            )
        if flag == "--target-modules" and not any(isinstance(m, nn.Linear) for m in matches):
            kind = type(matches[0]).__name__
            if "expert" in kind.lower():
                raise ValueError(
                    f"{flag} {target}: the MoE experts of {type(model).__name__} are fused "
                    f"weights ({kind}), which PEFT cannot wrap in adapters; train LoRA on the "
                    f"attention and dense layers: {', '.join(linear)}"
                )
            raise ValueError(
                f"{flag} {target} is a {kind}, not a linear layer; LoRA adapts linear layers: "
                f"{', '.join(linear)}"
            )


def _check_adapter_dir(args: LoraArgs, model: nn.Module, hf_checkpoint: str) -> None:
    """--lora-adapter-path: a PEFT LoRA adapter of --lora-rank whose matrices fit the model."""
    path = Path(str(args.lora_adapter_path))
    config_file, weights_file = path / ADAPTER_CONFIG_FILE, path / ADAPTER_WEIGHTS_FILE
    for file in (config_file, weights_file):
        if not file.is_file():
            raise ValueError(
                f"--lora-adapter-path {path}: no {file.name}; pass a PEFT adapter directory "
                f"(what PeftModel.save_pretrained writes: {ADAPTER_CONFIG_FILE} and "
                f"{ADAPTER_WEIGHTS_FILE})"
            )
    saved = json.loads(config_file.read_text())
    if saved.get("peft_type") != "LORA":
        raise ValueError(
            f"--lora-adapter-path {path} is a {saved.get('peft_type')} adapter, not LoRA"
        )
    if saved.get("r") != args.lora_rank:
        raise ValueError(
            f"--lora-adapter-path {path} has rank r={saved.get('r')}, but --lora-rank is "
            f"{args.lora_rank}; pass --lora-rank {saved.get('r')}"
        )
    for key in ("use_dora", "modules_to_save"):
        if saved.get(key):
            raise ValueError(
                f"--lora-adapter-path {path} sets {key}={saved[key]!r}, which miles does not "
                "train or serve; use a plain LoRA adapter"
            )
    misfit = (
        f"--lora-adapter-path {path} does not fit {hf_checkpoint} (trained on another base? it "
        f"names {saved.get('base_model_name_or_path')!r})"
    )
    _add_adapters_or_explain(model, args, misfit)
    expected = {name: tuple(t.shape) for name, t in adapter_matrices(model)}
    found = _safetensors_shapes(weights_file)
    for name, shape in expected.items():
        if found.get(name) != shape:
            raise ValueError(
                f"{misfit}: {name} is {found.get(name, 'missing')}, the model needs {shape}"
            )


def _add_adapters_or_explain(model: nn.Module, args: LoraArgs, why: str) -> None:
    """PEFT's adapters on the (meta) model, or a ValueError that starts with `why`."""
    try:
        get_peft_model(model, lora_config(args))
    except ValueError as err:
        raise ValueError(f"{why}: {err}") from err


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
