"""The LoRA serving flags of the reference engine (SGLang's spellings), checked and expanded once at
start-up: `--enable-lora`, `--max-lora-rank`, `--lora-target-modules`, `--max-loras-per-batch`,
`--lora-paths`. Plain Python: the flags are checked before the model loads.
"""

from __future__ import annotations

from dataclasses import dataclass

LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections the engine adapts: the dense decoder layer's linear layers, by their Hugging
Face names (what PEFT adapters name). SGLang's fused `qkv_proj` / `gate_up_proj` exist only inside
SGLang's own model code, and adapted embeddings or output heads are not served."""
ALL_TARGETS = "all"


@dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """What the LoRA flags ask for."""

    enabled: bool
    """--enable-lora (or --lora-paths)."""
    max_rank: int | None
    """--max-lora-rank; None: the largest rank of the start-up adapters."""
    target_modules: frozenset[str] | None
    """--lora-target-modules with `all` expanded; None: those the start-up adapters adapt."""
    max_per_batch: int
    """--max-loras-per-batch."""
    start_adapters: dict[str, str]
    """--lora-paths as {name: path}, loaded at start-up in this order."""

    @classmethod
    def from_flags(
        cls,
        *,
        enable_lora: bool,
        max_lora_rank: int | None,
        lora_target_modules: list[str] | None,
        max_loras_per_batch: int,
        lora_paths: list[str] | None,
    ) -> LoraSettings:
        if max_loras_per_batch < 1:
            raise ValueError(f"--max-loras-per-batch must be >= 1, got {max_loras_per_batch}")
        if not enable_lora:
            for flag, value in (("--max-lora-rank", max_lora_rank),
                                ("--lora-target-modules", lora_target_modules)):  # fmt: skip
                if value is not None:
                    raise ValueError(
                        f"{flag} ({value}) has no effect without --enable-lora; add "
                        "--enable-lora or drop the flag"
                    )
            return cls(enabled=False, max_rank=None, target_modules=None,
                       max_per_batch=max_loras_per_batch, start_adapters={})  # fmt: skip
        if max_lora_rank is not None and max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {max_lora_rank}")
        start = parse_lora_paths(lora_paths or [])
        missing = [flag for flag, value in (("--max-lora-rank", max_lora_rank),
                                            ("--lora-target-modules", lora_target_modules))
                   if value is None]  # fmt: skip
        if missing and not start:
            raise ValueError(
                f"--enable-lora without --lora-paths needs {' and '.join(missing)}: adapters "
                "loaded later (/load_lora_adapter) are checked against them; e.g. "
                "--max-lora-rank 16 --lora-target-modules all"
            )
        targets = None if lora_target_modules is None else expand_targets(lora_target_modules)
        return cls(enabled=True, max_rank=max_lora_rank, target_modules=targets,
                   max_per_batch=max_loras_per_batch, start_adapters=start)  # fmt: skip


def expand_targets(names: list[str]) -> frozenset[str]:
    """--lora-target-modules as the set of projection names (`all`: every one the engine adapts)."""
    if not names:
        raise ValueError(
            f"--lora-target-modules needs at least one of {', '.join(LORA_TARGET_MODULES)} or all"
        )
    if ALL_TARGETS in names:
        if len(names) > 1:
            raise ValueError(f"--lora-target-modules all must stand alone, got {names}")
        return frozenset(LORA_TARGET_MODULES)
    unknown = [name for name in names if name not in LORA_TARGET_MODULES]
    if unknown:
        raise ValueError(
            f"--lora-target-modules {unknown} are not projections the reference engine adapts; "
            f"choose from {', '.join(LORA_TARGET_MODULES)}, or all"
        )
    return frozenset(names)


def parse_lora_paths(entries: list[str]) -> dict[str, str]:
    """--lora-paths entries, NAME=PATH or PATH (then named by its path, as SGLang does)."""
    adapters: dict[str, str] = {}
    for entry in entries:
        name, _, path = entry.partition("=") if "=" in entry else (entry, "", entry)
        if not name or not path:
            raise ValueError(f"--lora-paths entry {entry!r} must be NAME=PATH or PATH")
        if name in adapters:
            raise ValueError(
                f"--lora-paths names adapter {name!r} twice ({adapters[name]} and {path}); "
                "give each its own name"
            )
        adapters[name] = path
    return adapters
