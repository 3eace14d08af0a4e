"""`LoraArgs`: the LoRA settings of a training backend (--lora-rank > 0 trains adapters instead of
every weight), declared once for every backend; `TrainerArgs` inherits them.

Upstream miles' spellings. Only what needs no checkpoint is checked here; the backend checks the
target modules and a start adapter against the checkpoint when the config is built
(`TrainerArgs.check_checkpoint`), and a backend that trains no adapters refuses --lora-rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from miles.config.options import flag_name as flag

ALL_LINEAR = "all-linear"
"""--target-modules value: every linear layer but the output head (PEFT's shorthand)."""

LORA_ADAPTER_NAME = "miles-policy"
"""The name under which the rollout engines serve the trained adapter (--lora-sync adapter):
every generate request of the rollout names it as SGLang's `lora_path`."""


@dataclass(kw_only=True)
class LoraArgs:
    """LoRA adapters on the policy: rank, scaling, where they go, how the engines get them."""

    lora_rank: int = 0
    """LoRA adapter rank r; 0 trains every weight (full fine-tuning)."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the adapter adds (alpha / r) * B @ A to each targeted weight."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input while training, in [0, 1)."""
    target_modules: str = ALL_LINEAR
    """Where adapters go: all-linear (every linear layer but the output head), or a comma list
    of module names (q_proj,v_proj) matched against the last part of each module's name."""
    exclude_modules: str | None = None
    """A comma list of module names kept without adapters, out of --target-modules."""
    lora_adapter_path: str | None = None
    """Start from this PEFT adapter directory (adapter_config.json + adapter_model.safetensors)
    instead of a fresh one; its rank must equal --lora-rank, its alpha and targets are used."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """How the rollout engines get the policy: merged sends base + (alpha / r) * B @ A of the
    adapted layers only (any engine); adapter has the engines serve the base and load the
    adapter (SGLang's --enable-lora and /load_lora_adapter), a few MB per update."""
    lora_sync_dir: str | None = None
    """--lora-sync adapter: directory the trainer writes each adapter version into for the
    engines to load; must be readable by every engine (a shared filesystem across nodes).
    Default: a fresh temporary directory on train rank 0's host."""

    @property
    def uses_lora(self) -> bool:
        return self.lora_rank > 0

    def target_module_names(self) -> list[str] | str:
        """--target-modules as PEFT takes it: the all-linear shorthand or a list of names."""
        if self.target_modules == ALL_LINEAR:
            return ALL_LINEAR
        return _names(self.target_modules)

    def exclude_module_names(self) -> list[str]:
        return _names(self.exclude_modules or "")

    def _check_lora(self) -> None:
        if self.lora_rank < 0:
            raise ValueError(
                f"--lora-rank must be >= 0 (0 trains every weight), got {self.lora_rank}"
            )
        if not self.uses_lora:
            self._check_no_lora_flags()
            return
        if not self.lora_alpha > 0:
            raise ValueError(
                f"--lora-alpha must be > 0 (the adapters are scaled by alpha / r), got "
                f"{self.lora_alpha}; 2 x --lora-rank is a common choice"
            )
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.target_modules != ALL_LINEAR and not _names(self.target_modules):
            raise ValueError(
                f"--target-modules {self.target_modules!r} names no module; use all-linear or a "
                "comma list such as q_proj,k_proj,v_proj,o_proj"
            )
        overlap = set(self.exclude_module_names()) & set(_names(self.target_modules))
        if overlap:
            raise ValueError(
                f"--exclude-modules {sorted(overlap)} are also in --target-modules; a module is "
                "either adapted or excluded: drop it from one of the two"
            )

    def _check_no_lora_flags(self) -> None:
        """Adapter settings without --lora-rank would silently do nothing."""
        for f in dataclasses.fields(LoraArgs):
            if f.name != "lora_rank" and getattr(self, f.name) != f.default:
                raise ValueError(
                    f"{flag(f.name)} {getattr(self, f.name)!r} has no effect without LoRA "
                    "(--lora-rank is 0); set --lora-rank, e.g. 16, or drop the flag"
                )


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]
