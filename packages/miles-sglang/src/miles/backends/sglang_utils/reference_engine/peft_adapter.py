"""Reading a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`, what
`PeftModel.save_pretrained` writes) without peft: the adapter's scaling and each adapted module's A
and B matrices. Options that change the forward in ways the engine does not compute (DoRA, biases,
modules_to_save, per-module ranks or alphas, ...) are refused by name, never read as plain LoRA.
Whether the adapter fits the served model is `lora_registry`'s business.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import load_file
from torch import Tensor

from miles.backends.sglang_utils.reference_engine.errors import InvalidRequestError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's saved names: base_model.model.<module path in the model>.lora_A.weight (and lora_B).
_PREFIX = "base_model.model."
_MATRICES = {".lora_A.weight": 0, ".lora_B.weight": 1}

# Config options that add to or change the LoRA forward, and what they would mean: refused when
# set (truthy), because serving the adapter without them would silently compute something else.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora) rescales every adapted layer by a magnitude vector",
    "lora_bias": "lora_bias adds a trained bias to lora_B",
    "modules_to_save": "modules_to_save replaces whole modules with trained copies",
    "fan_in_fan_out": "fan_in_fan_out stores transposed (Conv1D) weights",
    "rank_pattern": "rank_pattern gives modules their own ranks",
    "alpha_pattern": "alpha_pattern gives modules their own alphas",
    "target_parameters": "target_parameters adapts parameters of non-linear modules",
    "trainable_token_indices": "trainable_token_indices trains token embeddings",
    "layer_replication": "layer_replication repeats decoder layers",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) adapts only after its tokens",
    "arrow_config": "arrow_config routes tokens between adapters",
    "use_qalora": "use_qalora pools inputs for quantized bases",
    "use_bdlora": "use_bdlora makes the matrices block-diagonal",
}


@dataclass(frozen=True, eq=False)
class PeftLora:
    """One adapter as saved: its settings and matrices (on the CPU, in their saved dtype)."""

    path: str
    rank: int
    """The config's `r`."""
    scaling: float
    """PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    target_modules: tuple[str, ...]
    """The config's target_modules when a list, as projection names (`q_proj`): PEFT writes the
    full module paths it resolved all-linear to, and SGLang also keeps each name's last part.
    (): a regex string, matched by PEFT at training time; the matrices then say which modules
    are adapted."""
    layers: dict[str, tuple[Tensor, Tensor]]
    """Module path in the model (`model.layers.0.self_attn.q_proj`) -> (A (r, in), B (out, r))."""

    @property
    def adapted_names(self) -> frozenset[str]:
        """The projection names the matrices adapt (`q_proj`, ...)."""
        return frozenset(path.rsplit(".", 1)[-1] for path in self.layers)


def read_peft_lora(path: str) -> PeftLora:
    """The adapter in directory `path`; InvalidRequestError naming what is missing or malformed."""
    directory = Path(path)
    if not directory.is_dir():
        raise InvalidRequestError(
            f"lora_path {path!r} is not a directory; give the directory PeftModel.save_pretrained "
            f"wrote ({CONFIG_FILE} + {WEIGHTS_FILE}), readable by the engine's host"
        )
    config = _read_config(directory / CONFIG_FILE)
    rank, scaling = _scaling(config, path)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        pickled = (directory / "adapter_model.bin").is_file()
        raise InvalidRequestError(
            f"{path} has no {WEIGHTS_FILE}"
            + (
                "; only adapter_model.bin (a pickle): save with safe_serialization=True"
                if pickled
                else ""
            )
        )
    try:
        tensors = load_file(str(weights))
    except Exception as err:  # safetensors raises its own error type for a bad header
        raise InvalidRequestError(f"cannot read {weights}: {type(err).__name__}: {err}") from None
    targets = config.get("target_modules")
    return PeftLora(
        path=path,
        rank=rank,
        scaling=scaling,
        target_modules=_projection_names(targets) if isinstance(targets, list) else (),
        layers=_layers(tensors, rank, weights),
    )


def _projection_names(targets: list[str]) -> tuple[str, ...]:
    return tuple(sorted({str(target).rsplit(".", 1)[-1] for target in targets}))


def _read_config(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise InvalidRequestError(f"{file.parent} has no {CONFIG_FILE}; is it a PEFT adapter?")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise InvalidRequestError(f"cannot read {file}: {type(err).__name__}: {err}") from None
    if not isinstance(config, dict):
        raise InvalidRequestError(f"{file} holds {type(config).__name__}, not a JSON object")
    if config.get("peft_type") != "LORA":
        raise InvalidRequestError(
            f"{file} is a {config.get('peft_type')!r} adapter; the engine serves LORA adapters only"
        )
    refused = [why for key, why in _UNSUPPORTED.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        refused.append(f"bias={config['bias']!r} trains the base model's biases")
    if refused:
        raise InvalidRequestError(
            f"{file}: the engine serves plain LoRA (y = x W^T + scaling * x A^T B^T); "
            f"{'; '.join(refused)}: train the adapter without it"
        )
    return config


def _scaling(config: dict[str, Any], path: str) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidRequestError(f"{path}: {CONFIG_FILE} r ({rank!r}) must be an integer >= 1")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise InvalidRequestError(f"{path}: {CONFIG_FILE} lora_alpha ({alpha!r}) must be a number")
    # PEFT's LoraLayer.update_layer: rsLoRA divides by sqrt(r) (Kalajdzievski, 2023).
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _layers(tensors: dict[str, Tensor], rank: int, file: Path) -> dict[str, tuple[Tensor, Tensor]]:
    pairs: dict[str, list[Tensor | None]] = {}
    for name, tensor in tensors.items():
        matrix = next((m for m in _MATRICES if name.endswith(m)), None)
        if not name.startswith(_PREFIX) or matrix is None:
            raise InvalidRequestError(
                f"{file} holds {name!r}; a LoRA adapter of linear layers holds "
                f"{_PREFIX}<module>.lora_A.weight and .lora_B.weight only"
            )
        module = name[len(_PREFIX) : -len(matrix)]
        pairs.setdefault(module, [None, None])[_MATRICES[matrix]] = tensor
    if not pairs:
        raise InvalidRequestError(f"{file} holds no LoRA matrices")
    layers = {}
    for module, (a, b) in pairs.items():
        if a is None or b is None:
            raise InvalidRequestError(
                f"{file} has lora_{'B' if a is None else 'A'} of {module} without its "
                f"lora_{'A' if a is None else 'B'}"
            )
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise InvalidRequestError(
                f"{file}: {module}.lora_A is {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"expected (r, in_features) and (out_features, r) with the config's r = {rank}"
            )
        layers[module] = (a, b)
    return layers
