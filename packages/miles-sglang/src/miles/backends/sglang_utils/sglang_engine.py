"""Launch a real SGLang server (`python -m sglang.launch_server`) and own its whole process tree.

Every SGLang server flag passes through from miles's command line as `--sglang-<flag>`. SGLang is
the optional, GPU-only extra: nothing here imports it, and `require_sglang` says what to install.
The process tree itself is `server_process.ServerProcess`, shared with the router and the
reference engine.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from miles.backends.sglang_utils.router import add_worker, remove_worker
from miles.backends.sglang_utils.server_process import ServerProcess
from miles.backends.sglang_utils.sglang_flags import SGLANG_FLAG_PREFIX, SGLangFlagValue
from miles.backends.sglang_utils.sync_client import SyncEngineClient

logger = logging.getLogger(__name__)

_GPU_KINDS = ("cuda", "rocm")
# SGLang flags that SGLangEngineConfig sets itself, with the field that owns each.
_OWNED_FLAGS = {
    "model-path": "model_path",
    "host": "host",
    "port": "port",
    "tp-size": "tp_size",
    "tp": "tp_size",
    "tensor-parallel-size": "tp_size",
    "mem-fraction-static": "mem_fraction_static",
    "dtype": "dtype",
    "random-seed": "random_seed",
}


class SGLangUnavailableError(ImportError):
    """SGLang is not installed, or this machine has no GPU it runs on."""


def require_sglang() -> None:
    """Raise SGLangUnavailableError unless SGLang is installed and a CUDA or ROCm GPU is present."""
    # Imported here: the device module imports torch, which the engine's Ray actor (it only
    # starts the server process) otherwise never needs.
    from miles.backends.training_utils.infra.device import get_device_info

    installed = importlib.util.find_spec("sglang") is not None
    kind = get_device_info().kind
    if installed and kind in _GPU_KINDS:
        return
    raise SGLangUnavailableError(
        "the SGLang engine needs SGLang on a CUDA or ROCm GPU machine: `uv pip install "
        "'miles-sglang[sglang]'` (which brings SGLang's own torch build); use --rollout-engine "
        "reference on CPU "
        f"(found: sglang {'installed' if installed else 'not installed'}, device {kind})"
    )


@dataclass(kw_only=True)
class SGLangEngineConfig:
    """One SGLang server: the flags miles sets itself, plus every `--sglang-*` flag verbatim."""

    model_path: str
    """Hugging Face checkpoint directory or hub id the server loads."""
    host: str = "127.0.0.1"
    """Address the HTTP server binds; use the node's address to serve a router on another node."""
    port: int = 30000
    """HTTP port of the server."""
    tp_size: int = 1
    """Tensor-parallel GPUs per engine."""
    mem_fraction_static: float | None = None
    """Fraction of GPU memory for weights and KV cache; None lets SGLang choose."""
    dtype: str = "auto"
    """Weight and activation dtype (auto, bfloat16, float16, float32)."""
    random_seed: int | None = None
    """Sampling seed of the server; None lets SGLang choose."""
    extra_args: dict[str, SGLangFlagValue] = field(default_factory=dict)
    """Other SGLang flags, no dashes: {"context-length": "4096"} from --sglang-context-length."""
    startup_timeout_s: float = 600.0
    """How long `start` waits for /health_generate (loading a large model takes minutes)."""
    visible_devices: list[str] | None = None
    """Ids of the GPUs on this node the server drives, one per tensor-parallel rank (its
    CUDA_VISIBLE_DEVICES); None: the devices this process sees."""

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is empty; pass the checkpoint directory or hub id")
        if not 0 < self.port < 65536:
            raise ValueError(f"port ({self.port}) must be in 1..65535")
        if self.tp_size < 1:
            raise ValueError(f"tp_size ({self.tp_size}) must be at least 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError(
                f"mem_fraction_static ({self.mem_fraction_static}) must be in (0, 1]; "
                "lower it if the server runs out of memory"
            )
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s ({self.startup_timeout_s}) must be positive")
        if self.visible_devices is not None and len(self.visible_devices) != self.tp_size:
            raise ValueError(
                f"visible_devices {self.visible_devices} names {len(self.visible_devices)} "
                f"GPU(s) for tp_size {self.tp_size}: give the server one GPU per tensor-parallel "
                "rank"
            )
        for name, value in self.extra_args.items():
            if name.startswith("-"):
                raise ValueError(f"extra_args key {name!r} must be a flag name without dashes")
            if name in _OWNED_FLAGS:
                owner = _OWNED_FLAGS[name]
                flag = f"{SGLANG_FLAG_PREFIX}{name}"
                raise ValueError(
                    f"{flag} ({value}) sets what SGLangEngineConfig.{owner} sets "
                    f"({getattr(self, owner)}); drop {flag} and set {owner}"
                )

    @property
    def api_key(self) -> str | None:
        """The server's --api-key, which every client of it must send."""
        value = self.extra_args.get("api-key")
        return value if isinstance(value, str) else None


def build_launch_command(config: SGLangEngineConfig, python: str = sys.executable) -> list[str]:
    """The argv that starts this SGLang server."""
    command = [python, "-m", "sglang.launch_server", "--model-path", config.model_path]
    command += ["--host", config.host, "--port", str(config.port)]
    command += ["--tp-size", str(config.tp_size), "--dtype", config.dtype]
    if config.mem_fraction_static is not None:
        command += ["--mem-fraction-static", str(config.mem_fraction_static)]
    if config.random_seed is not None:
        command += ["--random-seed", str(config.random_seed)]
    for name, value in config.extra_args.items():
        if value is False:
            continue  # a switch left off
        command.append(f"--{name}")
        if isinstance(value, list):
            command += value
        elif value is not True:
            command.append(value)
    return command


def visible_devices_env(devices: list[str] | None) -> dict[str, str] | None:
    """The environment that makes a server see exactly `devices` (None: leave it as it is).

    A Ray actor sees only the GPU of its own bundle; an engine spanning several bundles must be
    shown all of them. HIP reads CUDA_VISIBLE_DEVICES too."""
    if devices is None:
        return None
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices)}


class SGLangEngine:
    """A real SGLang server: launched, health-checked, registered with routers, shut down.

    `launch_command` replaces `build_launch_command(config)` (a wrapper such as numactl, or a
    stand-in server in tests); it then skips the install check, which is the caller's business.
    """

    def __init__(
        self,
        config: SGLangEngineConfig,
        *,
        launch_command: list[str] | None = None,
        log_path: str | Path | None = None,
    ):
        self.config = config
        self.launch_command = launch_command
        self.log_path = log_path
        self._process: ServerProcess | None = None
        self._client: SyncEngineClient | None = None
        self._routers: list[str] = []

    @property
    def url(self) -> str:
        # A wildcard bind is reachable on loopback; set host to the node's address for remote use.
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::", "") else self.config.host
        return f"http://{host}:{self.config.port}"

    @property
    def pid(self) -> int | None:
        """Process id of the running server (None before start and after shutdown)."""
        return self._process.pid if self._process is not None else None

    @property
    def client(self) -> SyncEngineClient:
        """A client of this server (created on first use, closed by shutdown)."""
        if self._client is None:
            self._client = SyncEngineClient(self.url, api_key=self.config.api_key)
        return self._client

    def start(self) -> None:
        """Launch the server and wait until /health_generate answers."""
        if self._process is not None:
            raise RuntimeError(f"SGLang engine {self.url} is already started")
        if self.launch_command is None:
            require_sglang()
        command = self.launch_command or build_launch_command(self.config)
        name = f"sglang-{self.config.port}"
        process = ServerProcess(
            command,
            name=name,
            log_path=self.log_path,
            env=visible_devices_env(self.config.visible_devices),
        )
        try:
            process.wait_until_ready(
                f"{self.url}/health_generate", timeout_s=self.config.startup_timeout_s
            )
        except BaseException:  # also Ctrl-C while waiting: leave no server behind
            process.shutdown()  # idempotent: a failed wait has already done it
            raise
        self._process = process

    def register_with_router(self, router_url: str, timeout_s: float = 60.0) -> None:
        """Add this server to a running sglang-router; shutdown removes it again."""
        add_worker(router_url, self.url, timeout_s=timeout_s)
        self._routers.append(router_url)

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Leave the routers, close the client and kill the server's process tree; idempotent."""
        for router_url in self._routers:
            try:
                remove_worker(router_url, self.url, timeout_s=10.0)
            except Exception as exc:  # the router may be gone already; the kill must still happen
                logger.warning("could not remove %s from router %s: %s", self.url, router_url, exc)
        self._routers.clear()
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._process is not None:
            self._process.shutdown(grace_s)
            self._process = None

    def __enter__(self) -> SGLangEngine:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
