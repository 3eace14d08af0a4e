"""The rollout engines miles core can start, registered under the `miles.rollout_engines` entry point.

Core picks an engine by name (`--rollout-engine reference|sglang`) and never imports this module by
name: both launchers implement `engine_launcher.EngineLauncher` over one `EngineLaunchSpec`, so the
rollout manager treats a real SGLang server and the reference engine alike.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from miles.backends.sglang_utils.engine_launcher import EngineLaunchSpec
from miles.backends.sglang_utils.server_process import ADMIN_KEY_ENV, ServerProcess, free_port
from miles.backends.sglang_utils.sglang_engine import (
    SGLangEngine,
    SGLangEngineConfig,
    visible_devices_env,
)

logger = logging.getLogger(__name__)


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
        for flag, value in spec.lora_flags().items():
            command += [f"--{flag}"] if value is True else [f"--{flag}", *_values(value)]
        return command

    def start(self) -> str:
        if self._process is not None:
            raise RuntimeError(f"reference engine {self.url} is already started")
        env = {**(visible_devices_env(self.spec.visible_devices) or {}), **self.spec.thread_env()}
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


def _values(value: str | list[str]) -> list[str]:
    return value if isinstance(value, list) else [value]


class SGLangEngineLauncher:
    """A real SGLang server (GPUs; `start` says how to install SGLang when it is missing).
    The spec's `cpu_threads` is not passed on: SGLang runs on GPUs, where runs leave it None."""

    def __init__(self, spec: EngineLaunchSpec):
        self.spec = spec
        extra = dict(spec.extra_args)
        if spec.admin_api_key:
            extra.setdefault("admin-api-key", spec.admin_api_key)
        if spec.max_running_requests is not None:
            extra.setdefault("max-running-requests", str(spec.max_running_requests))
        if spec.return_routed_experts:
            extra.setdefault("enable-return-routed-experts", True)
        for flag, value in spec.lora_flags().items():
            extra.setdefault(flag, value)
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
