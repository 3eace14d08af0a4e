"""External rollout engines in the configuration: the settings of other groups a run refuses with them.

A run given --rollout-external-engine-addrs launches no engine (architecture.md: "Fault tolerance",
docs/guides/recipes.md: "External engines"). Every setting that shapes an engine's launch, its
devices or its restart would then be silently ignored, and colocation (putting engines to sleep to
share their devices) is not the run's to do to a server it does not own: each is refused here,
before anything starts, naming the flag, its value and the fix. The addresses and the cluster
settings are checked where `ClusterConfig` is built (`miles.config.engine_addresses`); these run
with the checks across groups. Nothing here imports Ray.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from miles.config.engine_addresses import FLAG

if TYPE_CHECKING:
    from miles.backends.training_utils.algorithms.distillation import DistillationConfig
    from miles.config.groups import ClusterConfig, EngineConfig, TrainingConfig
    from miles.config.trainer_args import TrainerArgs
    from miles.rollout.rollout_config import RolloutConfig

# EngineConfig fields that only configure engines the run launches (or restarts).
_LAUNCH_SETTINGS = {
    "engine_dtype": "--engine-dtype",
    "engine_max_running_requests": "--engine-max-running-requests",
    "engine_mem_fraction_static": "--engine-mem-fraction-static",
    "engine_log_dir": "--engine-log-dir",
    "sglang_server_args": "--sglang-server-args (or --sglang-<flag>)",
    "max_engine_restarts": "--max-engine-restarts",
}


def check_settings(
    cluster: ClusterConfig,
    engine: EngineConfig,
    training: TrainingConfig,
    rollout: RolloutConfig,
    distillation: DistillationConfig,
    backend: TrainerArgs | None,
) -> None:
    """Settings of the other groups that need engines the run launches itself."""
    addrs = cluster.rollout_external_engine_addrs
    if not addrs:
        return
    given = f"{FLAG} ({' '.join(addrs)})"
    defaults = {f.name: f.default for f in dataclasses.fields(engine)}
    for name, flag in _LAUNCH_SETTINGS.items():
        value: Any = getattr(engine, name)
        if value == defaults[name]:
            continue
        if name == "max_engine_restarts":
            raise ValueError(f"{flag} ({value}) with {given}: a lost external engine is never "
                             f"restarted (the run cannot start it); drop {flag}")  # fmt: skip
        raise ValueError(f"{flag} ({value}) with {given}: it configures the engines a run "
                         "launches, and this run launches none, so it would be ignored; drop "
                         f"{flag} and set it on your engine servers instead")  # fmt: skip
    needs_launch = (
        (training.debug_train_only, "--debug-train-only",
         "trains on saved rollouts and would never use the external engines; drop "
         f"{FLAG}"),
        (distillation.use_opd, "--use-opd",
         "launches its teacher engines with the launch settings of the run's own engines, and "
         f"there are none; drop {FLAG} to let the run launch its engines"),
        (rollout.return_routed_experts, "--return-routed-experts / --use-rollout-routing-replay",
         "needs engines started with --enable-return-routed-experts, which the run cannot give "
         f"engines it did not launch; drop it, or drop {FLAG}"),
        (backend is not None and backend.uses_lora and backend.lora_sync == "adapter",
         "--lora-sync adapter",
         "needs engines started with LoRA serving (--enable-lora, --max-lora-rank), which the "
         "run cannot give engines it did not launch; use --lora-sync merged"),
    )  # fmt: skip
    for used, flag, why in needs_launch:
        if used:
            raise ValueError(f"{flag} with {given}: it {why}")
