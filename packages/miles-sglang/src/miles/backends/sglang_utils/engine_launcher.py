"""The engine-launcher contract: what miles core hands a rollout engine to start it
(`EngineLaunchSpec`) and what it calls on the launcher (`EngineLauncher`).

A launcher class is registered under the `miles.rollout_engines` entry point and picked by
`--rollout-engine`; core builds it from one spec in the engine's Ray actor
(`miles.ray.engine_actor`) and never imports it by name. The built-in ones are in
`engine_launchers`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

__all__ = ["EngineLaunchSpec", "EngineLauncher"]


@runtime_checkable
class EngineLauncher(Protocol):
    """One engine process: built from an `EngineLaunchSpec`, started once, stopped once."""

    @property
    def url(self) -> str:
        """Where the engine serves SGLang's HTTP API (known before `start`)."""
        ...

    @property
    def pid(self) -> int | None:
        """The engine server's process id once started; None before."""
        ...

    def start(self) -> str:
        """Launch the engine, wait until it answers /health; its URL."""
        ...

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop the engine's process tree (SIGKILL after `grace_s`); idempotent."""
        ...


@dataclass(kw_only=True)
class EngineLaunchSpec:
    """One engine to start: what it serves, where, and on how many devices."""

    model_path: str
    """Hugging Face checkpoint directory the engine loads."""
    host: str = "127.0.0.1"
    """Address to bind and to advertise; the node's address when clients run on other nodes."""
    port: int = 0
    """HTTP port; 0 picks a free one."""
    num_devices: int = 1
    """Devices of this engine (SGLang's tensor-parallel size)."""
    dtype: str = "auto"
    """Weight dtype: auto (the checkpoint's), float32, bfloat16 or float16."""
    max_running_requests: int | None = None
    """Sequences decoded together; None: the engine's default."""
    mem_fraction_static: float | None = None
    """SGLang: fraction of GPU memory for weights and KV cache."""
    random_seed: int = 0
    """Seed of requests that carry none."""
    startup_timeout_s: float = 600.0
    """How long `start` waits for the engine's health endpoint."""
    log_path: str | None = None
    """File for the engine's output (None: inherit the caller's)."""
    visible_devices: list[str] | None = None
    """GPU ids on this node the engine drives, `num_devices` of them (its bundles' GPUs); None:
    the devices the launching process sees."""
    admin_api_key: str | None = None
    """The key of the engine's admin routes (weights, memory, pause, abort); None: open."""
    extra_args: dict[str, str | bool | list[str]] = field(default_factory=dict)
    """SGLang only: other server flags without dashes ({"context-length": "4096"}; True for a
    switch, a list for several values)."""
    return_routed_experts: bool = False
    """Record a MoE model's routing for requests that ask (--enable-return-routed-experts, on
    SGLang and the reference engine alike): routing replay needs it."""
    enable_lora: bool = False
    """Serve LoRA adapters (--enable-lora on SGLang and the reference engine alike): a LoRA run
    syncs its adapter, not its weights."""
    max_lora_rank: int | None = None
    """With `enable_lora`: the largest adapter rank the engine accepts (--max-lora-rank)."""
    lora_target_modules: list[str] | None = None
    """With `enable_lora`: the projections adapters may adapt (--lora-target-modules, e.g.
    ["q_proj", "v_proj"] or ["all"])."""
    cpu_threads: int | None = None
    """Torch threads of a CPU engine, given to its server as OMP_NUM_THREADS and
    MKL_NUM_THREADS; None: inherit the launching process's (Ray's OMP_NUM_THREADS). Runs on GPUs
    leave it None, and the SGLang launcher ignores it."""

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"an engine needs at least one device, got {self.num_devices}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} is not a TCP port (0 picks a free one)")
        if self.visible_devices is not None and len(self.visible_devices) != self.num_devices:
            raise ValueError(
                f"visible_devices {self.visible_devices} names {len(self.visible_devices)} "
                f"device(s) for an engine of {self.num_devices}"
            )
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1 (None: inherit), got {self.cpu_threads}")
        self._check_lora()

    def thread_env(self) -> dict[str, str]:
        """The server's environment for `cpu_threads` ({} when None): torch sizes its thread
        pool from these when it loads."""
        if self.cpu_threads is None:
            return {}
        return {name: str(self.cpu_threads) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}

    def _check_lora(self) -> None:
        lora = {
            "max_lora_rank": self.max_lora_rank,
            "lora_target_modules": self.lora_target_modules,
        }
        if not self.enable_lora:
            given = [name for name, value in lora.items() if value is not None]
            if given:
                raise ValueError(
                    f"{' and '.join(given)} need enable_lora=True; set it or drop them"
                )
            return
        missing = [name for name, value in lora.items() if value is None or value == []]
        if missing:
            raise ValueError(
                f"enable_lora needs {' and '.join(missing)}: the engines check every adapter "
                "loaded later against them (e.g. max_lora_rank=16, lora_target_modules=['all'])"
            )
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")

    def lora_flags(self) -> dict[str, str | bool | list[str]]:
        """The LoRA server flags both engines take, without dashes ({} without enable_lora)."""
        if not self.enable_lora:
            return {}
        return {"enable-lora": True, "max-lora-rank": str(self.max_lora_rank),
                "lora-target-modules": list(self.lora_target_modules or [])}  # fmt: skip
