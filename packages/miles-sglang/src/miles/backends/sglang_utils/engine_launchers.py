"""The rollout engines miles core can start, registered under the `miles.rollout_engines` entry point.

Core picks an engine by name (`--rollout-engine reference|sglang`) and never imports this module by
name: both launchers take one `EngineLaunchSpec` and offer `start() -> url` and `shutdown()`, so the
rollout manager treats a real SGLang server and the reference engine alike.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from miles.backends.sglang_utils.server_process import ADMIN_KEY_ENV, ServerProcess, free_port
from miles.backends.sglang_utils.sglang_engine import (
    SGLangEngine,
    SGLangEngineConfig,
    visible_devices_env,
)

logger = logging.getLogger(__name__)


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


class ReferenceEngineLauncher:
    """The pure-PyTorch reference engine in its own process (any device, one device per engine)."""

    def __init__(self, spec: EngineLaunchSpec):
        if spec.num_devices != 1:
            raise ValueError(
                f"the reference engine runs on one device, got --rollout-num-gpus-per-engine "
                f"{spec.num_devices}; use 1, or --rollout-engine sglang for tensor parallelism"
            )
        if spec.extra_args:
            raise ValueError(
                f"SGLang server flags {sorted(spec.extra_args)} have no effect on the reference "
                "engine; drop them or use --rollout-engine sglang"
            )
        if spec.mem_fraction_static is not None:
            raise ValueError(
                "--engine-mem-fraction-static is an SGLang setting; the reference engine "
                "allocates its cache per request: drop the flag"
            )
        self.spec = spec
        self.port = spec.port or free_port(spec.host)
        self._process: ServerProcess | None = None

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    def command(self) -> list[str]:
        spec = self.spec
        command = [
            sys.executable, "-m", "miles.backends.sglang_utils.reference_engine.cli",
            "--model-path", spec.model_path, "--host", spec.host, "--port", str(self.port),
            "--dtype", spec.dtype, "--random-seed", str(spec.random_seed), "--log-level", "warning",
        ]  # fmt: skip
        if spec.max_running_requests is not None:
            command += ["--max-running-requests", str(spec.max_running_requests)]
        if spec.return_routed_experts:
            command.append("--enable-return-routed-experts")
        return command

    def start(self) -> str:
        if self._process is not None:
            raise RuntimeError(f"reference engine {self.url} is already started")
        env = visible_devices_env(self.spec.visible_devices) or {}
        if self.spec.admin_api_key:
            # In the environment, not on the command line that every local user can read.
            env[ADMIN_KEY_ENV] = self.spec.admin_api_key
        process = ServerProcess(
            self.command(), name=f"reference-engine-{self.port}", log_path=self.spec.log_path,
            env=env or None,
        )  # fmt: skip
        try:
            process.wait_until_ready(f"{self.url}/health", timeout_s=self.spec.startup_timeout_s)
        except BaseException:
            process.shutdown()
            raise
        self._process = process
        return self.url

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop the engine's process tree (SIGKILL after `grace_s`); idempotent."""
        if self._process is not None:
            self._process.shutdown(grace_s)
            self._process = None


class SGLangEngineLauncher:
    """A real SGLang server (GPUs; `start` says how to install SGLang when it is missing)."""

    def __init__(self, spec: EngineLaunchSpec):
        self.spec = spec
        extra = dict(spec.extra_args)
        if spec.admin_api_key:
            extra.setdefault("admin-api-key", spec.admin_api_key)
        if spec.max_running_requests is not None:
            extra.setdefault("max-running-requests", str(spec.max_running_requests))
        if spec.return_routed_experts:
            extra.setdefault("enable-return-routed-experts", True)
        self.engine = SGLangEngine(
            SGLangEngineConfig(
                model_path=spec.model_path,
                host=spec.host,
                port=spec.port or free_port(spec.host),
                tp_size=spec.num_devices,
                mem_fraction_static=spec.mem_fraction_static,
                dtype=spec.dtype,
                random_seed=spec.random_seed,
                extra_args=extra,
                startup_timeout_s=spec.startup_timeout_s,
                visible_devices=spec.visible_devices,
            ),
            log_path=Path(spec.log_path) if spec.log_path else None,
        )

    @property
    def url(self) -> str:
        return self.engine.url

    @property
    def pid(self) -> int | None:
        return self.engine.pid

    def start(self) -> str:
        self.engine.start()
        return self.url

    def shutdown(self, grace_s: float = 10.0) -> None:
        self.engine.shutdown(grace_s)
