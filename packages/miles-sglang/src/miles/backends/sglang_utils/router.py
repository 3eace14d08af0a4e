"""Run the real sglang-router (`python -m sglang_router.launch_router`) and manage its workers.

What sglang-router 0.3.2 does with its workers, found by experiment; an engine behind it (real
SGLang or the reference engine) must satisfy this:
- Registering a worker (`--worker-urls` or `POST /workers {"url"}`, which answers 202 and works
  in the background): `GET /health` must answer 200 (it also probes gRPC on the same port; a plain
  HTTP server logs that as an invalid request, harmlessly), then `GET /server_info` and
  `GET /model_info`, falling back to `GET /get_server_info` / `GET /get_model_info` on 404. The
  info calls are optional (without them the model id is "unknown"); from them it reads
  `model_path`, `tokenizer_path`, `tp_size`, `dp_size`, and tries to load a tokenizer from
  `model_path` (a local directory, else the Hugging Face hub; failure is only a warning).
- Health checks: `GET /health` every `--health-check-interval-secs` (default 60).
- `POST /generate` is parsed and re-serialised: it adds `model: null`, `stream`,
  `return_text_in_logprobs`, `log_metrics`, `return_hidden_states`, `background`, `no_logs`,
  `return_bytes`, `return_entropy` (all false) and DROPS fields it does not know, e.g.
  `return_routed_experts`, `lora_path`, and sampling_params `logit_bias`, `custom_params`,
  `spaces_between_special_tokens`; null values are dropped too. It keeps `input_ids`/`text`,
  `rid`, `return_logprob`, `logprob_start_len`, `top_logprobs_num`, `token_ids_logprob`,
  `session_params`, `priority`, `extra_key`, `data_parallel_rank` and the usual sampling_params
  (temperature, top_p, top_k, min_p, max_new_tokens, min_new_tokens, stop, stop_token_ids,
  ignore_eos, skip_special_tokens, no_stop_trim, n, penalties, sampling_seed). It retries failed
  requests on another worker (`--retry-max-retries`, default 5).
- Of the control API it forwards only `POST /flush_cache` (to every worker, empty body) and
  `GET /get_model_info` (to one worker); it answers `/health`, `/health_generate`, `/liveness`,
  `/readiness` and `/get_server_info` itself. Pause, abort, weight and memory calls are NOT
  routed (404): send them to each engine's own URL.
- Workers: `GET /workers` lists `{"workers": [{"id", "url", "is_healthy", ...}]}`;
  `DELETE /workers/{id}` removes one (202, background). The legacy `/add_worker?url=` is gone.
- Every router serves Prometheus metrics on port 29000 by default: a second router on the host
  panics at start unless it gets another `--prometheus-port`, so this module always picks one.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import httpx

from miles.backends.sglang_utils.engine_error import EngineError
from miles.backends.sglang_utils.server_process import ServerProcess, free_port

logger = logging.getLogger(__name__)

RouterPolicy = Literal["random", "round_robin", "cache_aware", "power_of_two", "manual"]
ROUTER_POLICIES: tuple[str, ...] = get_args(RouterPolicy)


class RouterUnavailableError(ImportError):
    """sglang-router is not installed."""


class RouterError(RuntimeError):
    """The router did not reach the state asked of it (e.g. a worker never became healthy)."""


def require_sglang_router() -> None:
    """Raise RouterUnavailableError unless the sglang_router package is importable."""
    if importlib.util.find_spec("sglang_router") is None:
        raise RouterUnavailableError(
            "the router needs `uv pip install sglang-router`; or run a single engine without one"
        )


def _admin_client(router_url: str, api_key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=router_url, headers=headers, timeout=10.0, trust_env=False)


def _call(http: httpx.Client, method: str, endpoint: str, **kwargs: Any) -> httpx.Response:
    """One admin call, never retried (adding and removing are not idempotent)."""
    router_url = str(http.base_url).rstrip("/")
    try:
        response = http.request(method, endpoint, **kwargs)
    except httpx.TransportError as exc:
        message = f"connection failed: {type(exc).__name__}: {exc}"
        raise EngineError(router_url, endpoint, None, message, "is the router running?") from exc
    if response.status_code == 404 and endpoint.startswith("/workers"):
        raise EngineError(
            router_url,
            endpoint,
            404,
            "this router has no /workers API",
            "use sglang-router 0.3 or newer: uv pip install 'sglang-router>=0.3'",
        )
    if not response.is_success:
        raise EngineError.from_response(router_url, endpoint, response)
    return response


def list_workers(router_url: str, *, api_key: str | None = None) -> list[dict[str, Any]]:
    """The router's workers: dicts with at least `id`, `url` and `is_healthy`."""
    with _admin_client(router_url, api_key) as http:
        return _list(http)


def _list(http: httpx.Client) -> list[dict[str, Any]]:
    return _call(http, "GET", "/workers").json()["workers"]


def _matching(workers: list[dict[str, Any]], worker_url: str) -> list[dict[str, Any]]:
    return [w for w in workers if w["url"].rstrip("/") == worker_url.rstrip("/")]


def _wait(http: httpx.Client, worker_url: str, *, present: bool, timeout_s: float) -> None:
    """Poll the worker list until `worker_url` is healthy in it (present) or gone from it."""
    router_url = str(http.base_url).rstrip("/")
    deadline = time.monotonic() + timeout_s
    while True:
        found = _matching(_list(http), worker_url)
        if any(w.get("is_healthy") for w in found) if present else not found:
            return
        if time.monotonic() >= deadline:
            state = "listed as healthy" if present else "removed"
            raise RouterError(
                f"router {router_url} has not {state} worker {worker_url} after {timeout_s:.0f} s "
                f"(router lists it as {found or 'absent'}); check that the worker answers GET "
                "/health, and read the router's log"
            )
        time.sleep(0.1)


def add_worker(
    router_url: str, worker_url: str, *, timeout_s: float = 60.0, api_key: str | None = None
) -> None:
    """Register `worker_url` with the router and wait until the router routes to it."""
    with _admin_client(router_url, api_key) as http:
        _call(http, "POST", "/workers", json={"url": worker_url})
        _wait(http, worker_url, present=True, timeout_s=timeout_s)
    logger.info("router %s routes to %s", router_url, worker_url)


def remove_worker(
    router_url: str, worker_url: str, *, timeout_s: float = 60.0, api_key: str | None = None
) -> None:
    """Deregister `worker_url` and wait until the router lists it no more; no-op if absent."""
    with _admin_client(router_url, api_key) as http:
        for worker in _matching(_list(http), worker_url):
            _call(http, "DELETE", f"/workers/{worker['id']}")
        _wait(http, worker_url, present=False, timeout_s=timeout_s)
    logger.info("router %s no longer routes to %s", router_url, worker_url)


@dataclass(kw_only=True)
class RouterConfig:
    """One sglang-router process."""

    worker_urls: list[str] = field(default_factory=list)
    """Workers to route to from the start; more can be added with `add_worker`."""
    host: str = "127.0.0.1"
    """Address the router (and its metrics endpoint) binds."""
    port: int | None = None
    """Router port; None picks a free one."""
    policy: RouterPolicy = "cache_aware"
    """Load balancing: cache_aware keeps prompts with a shared prefix (a GRPO group) together."""
    prometheus_port: int | None = None
    """Metrics port; None picks a free one (the router's default, 29000, clashes across routers)."""
    log_level: Literal["debug", "info", "warn", "error"] = "warn"
    """The router logs every request at info: a rollout would flood the log."""
    extra_args: list[str] = field(default_factory=list)
    """Further launch_router flags, verbatim (e.g. ["--health-check-interval-secs", "5"])."""
    startup_timeout_s: float = 60.0
    """How long `start` waits for the router and its initial workers."""

    def __post_init__(self) -> None:
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(
                f"router policy {self.policy!r} is not one of {', '.join(ROUTER_POLICIES)}"
            )
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s ({self.startup_timeout_s}) must be positive")


def build_router_command(
    config: RouterConfig, *, port: int, prometheus_port: int, python: str = sys.executable
) -> list[str]:
    """The argv that starts this router."""
    command = [python, "-m", "sglang_router.launch_router", "--host", config.host]
    command += ["--port", str(port), "--policy", config.policy, "--log-level", config.log_level]
    command += ["--prometheus-host", config.host, "--prometheus-port", str(prometheus_port)]
    if config.worker_urls:
        command += ["--worker-urls", *config.worker_urls]
    return command + config.extra_args


class RouterProcess:
    """A running sglang-router: `start`, `add_worker` / `remove_worker`, `shutdown`."""

    def __init__(self, config: RouterConfig, *, log_path: str | Path | None = None):
        self.config = config
        self.log_path = log_path
        self.port = config.port or free_port(config.host)
        self._process: ServerProcess | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::", "") else self.config.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        """Launch the router; return once it answers and routes to every initial worker."""
        if self._process is not None:
            raise RuntimeError(f"router {self.url} is already started")
        require_sglang_router()
        prometheus_port = self.config.prometheus_port or free_port(self.config.host)
        command = build_router_command(self.config, port=self.port, prometheus_port=prometheus_port)
        name = f"sglang-router-{self.port}"
        process = ServerProcess(command, name=name, log_path=self.log_path)
        start = time.monotonic()
        try:
            process.wait_until_ready(
                f"{self.url}/liveness", timeout_s=self.config.startup_timeout_s
            )
            # The router registers --worker-urls in the background, after it already answers.
            left_s = max(1.0, self.config.startup_timeout_s - (time.monotonic() - start))
            with _admin_client(self.url, None) as http:
                for worker_url in self.config.worker_urls:
                    _wait(http, worker_url, present=True, timeout_s=left_s)
        except BaseException:  # also Ctrl-C while waiting: leave no router behind
            process.shutdown()
            raise
        self._process = process

    def add_worker(self, worker_url: str, timeout_s: float = 60.0) -> None:
        """Route to `worker_url` too, once the router finds it healthy."""
        add_worker(self.url, worker_url, timeout_s=timeout_s)

    def remove_worker(self, worker_url: str, timeout_s: float = 60.0) -> None:
        """Stop routing to `worker_url`."""
        remove_worker(self.url, worker_url, timeout_s=timeout_s)

    def workers(self) -> list[str]:
        """URLs of the workers the router knows, healthy or not."""
        return [worker["url"] for worker in list_workers(self.url)]

    def log_tail(self, lines: int = 40) -> str:
        return self._process.log_tail(lines) if self._process else ""

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Kill the router's process tree; idempotent."""
        if self._process is not None:
            self._process.shutdown(grace_s)

    def __enter__(self) -> RouterProcess:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


@contextmanager
def running_router(
    worker_urls: Sequence[str] = (),
    *,
    policy: RouterPolicy = "round_robin",
    log_path: str | Path | None = None,
    **config: Any,
) -> Iterator[RouterProcess]:
    """A started router in front of `worker_urls`, shut down on exit (tests, local runs).

    Round robin by default, so that requests spread over the workers predictably; `config` takes
    the other RouterConfig fields.
    """
    router_config = RouterConfig(worker_urls=list(worker_urls), policy=policy, **config)
    router = RouterProcess(router_config, log_path=log_path)
    router.start()
    try:
        yield router
    finally:
        router.shutdown()
