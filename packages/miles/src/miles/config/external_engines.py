"""External rollout engines in the configuration: their addresses, and what a run refuses with them.

A run given --rollout-external-engine-addrs launches no engine (architecture.md: "Fault tolerance",
docs/guides/recipes.md: "External engines"). Every setting that shapes an engine's launch, its
devices or its restart would then be silently ignored, and colocation (putting engines to sleep to
share their devices) is not the run's to do to a server it does not own: each is refused here,
before anything starts, naming the flag, its value and the fix. Nothing here imports Ray.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from miles.backends.training_utils.algorithms.distillation import DistillationConfig
    from miles.config.groups import ClusterConfig, EngineConfig, TrainingConfig
    from miles.config.trainer_args import TrainerArgs
    from miles.rollout.rollout_config import RolloutConfig

FLAG = "--rollout-external-engine-addrs"

# EngineConfig fields that only configure engines the run launches (or restarts).
_LAUNCH_SETTINGS = {
    "engine_dtype": "--engine-dtype",
    "engine_max_running_requests": "--engine-max-running-requests",
    "engine_mem_fraction_static": "--engine-mem-fraction-static",
    "engine_log_dir": "--engine-log-dir",
    "sglang_server_args": "--sglang-server-args (or --sglang-<flag>)",
    "max_engine_restarts": "--max-engine-restarts",
}


def engine_url(addr: str) -> str:
    """The base URL of the engine at `addr` (`host:port`, or `http://host:port`); a ValueError
    naming the address otherwise."""
    text = addr.strip()
    parsed = urlsplit(text if "://" in text else f"http://{text}")
    example = "e.g. 127.0.0.1:30000 or http://engine-host:30000"
    try:
        port = parsed.port
    except ValueError:  # a port that is not a number, or out of range
        port = None
    if (
        parsed.scheme not in ("http", "https")
        or not parsed.hostname
        or port is None
        or (parsed.path not in ("", "/") or parsed.query or parsed.fragment)
    ):
        raise ValueError(f"{FLAG}: {addr!r} is not an engine address host:port ({example})")
    host = parsed.hostname
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a host name
    return f"{parsed.scheme}://{host}:{port}"


def check_cluster(cluster: ClusterConfig) -> None:
    """The cluster settings a run with external engines cannot honour (`ClusterConfig` calls
    this when it is built, with its own addresses parsed)."""
    addrs = cluster.rollout_external_engine_addrs
    if not addrs:
        return
    given = f"{FLAG} ({' '.join(addrs)})"
    urls = [engine_url(addr) for addr in addrs]
    repeated = sorted({url for url in urls if urls.count(url) > 1})
    if repeated:
        raise ValueError(f"{given} names {', '.join(repeated)} more than once; name each engine "
                         "once")  # fmt: skip
    if cluster.colocate:
        raise ValueError(
            f"{given} with --colocate: colocated engines sleep while the trainer uses their "
            "devices, and a run must not put servers it did not launch to sleep; drop --colocate "
            f"(or drop {FLAG} and let the run launch colocated engines)"
        )
    refused = (
        ("--rollout-num-gpus", cluster.rollout_num_gpus, None,
         "the run reserves no devices for engines it did not launch"),
        ("--rollout-num-gpus-per-engine", cluster.rollout_num_gpus_per_engine, 1,
         "external engines have their own tensor-parallel size"),
        ("--rollout-engine", cluster.rollout_engine, "auto",
         "external engines are whatever serves at their addresses"),
    )  # fmt: skip
    for flag, value, default, why in refused:
        if value != default:
            raise ValueError(f"{flag} ({value}) with {given}: {why}, so it would be ignored; "
                             f"drop {flag}")  # fmt: skip


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
