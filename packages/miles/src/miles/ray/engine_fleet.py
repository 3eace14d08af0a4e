"""`EngineFleet`: the rollout engines of a run, as one object the rollout manager holds.

It starts the engines (one `RolloutEngineActor` per engine, in the engine's placement bundle), and
the teachers with --use-opd; fronts them with sglang-router or the built-in least-loaded balancer
(`EnginePool`); with fault tolerance, supervises them, restarts a lost one at its URL and admits it
back once it has the trainers' weights; and `dispose()` stops every process it started. With
--rollout-external-engine-addrs it launches none: it checks the given engines
(`miles.ray.external_engines`), balances over them, treats a lost one as lost for good, and
leaves them running.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import secrets
import time
from pathlib import Path
from typing import Any

import ray
from miles.backends.sglang_utils.client import EngineClient, EngineError
from miles.backends.sglang_utils.router import RouterConfig, RouterProcess
from miles.backends.sglang_utils.server_process import file_tail
from miles.config.lora_args import ALL_LINEAR, LORA_ADAPTER_NAME
from miles.config.miles_config import MilesConfig
from miles.config.placement_plan import COLOCATED_ENGINE_SHARE
from miles.config.trainer_args import TrainerArgs
from miles.ray.cpu_threads import CpuThreads
from miles.ray.engine_actor import RolloutEngineActor
from miles.ray.external_engines import check_external_engines
from miles.ray.placement import Placement
from miles.ray.teacher_engines import TeacherEngines
from miles.rollout.engine_pool import EnginePool
from miles.rollout.engine_supervisor import EngineSupervisor, FaultToleranceConfig
from miles.utils.failures import describe
from miles.utils.plugins import ROLLOUT_ENGINES, installed_plugins

logger = logging.getLogger(__name__)


def resolve_engine(choice: str, has_gpus: bool) -> str:
    """--rollout-engine auto: SGLang with GPUs when installed, else the reference engine."""
    if choice != "auto":
        return choice
    sglang = importlib.util.find_spec("sglang") is not None and "sglang" in installed_plugins(
        ROLLOUT_ENGINES
    )
    return "sglang" if has_gpus and sglang else "reference"


def resolve_router(choice: str) -> str:
    """--rollout-router auto: sglang-router when installed, else the built-in balancer."""
    if choice != "auto":
        return choice
    return "sglang-router" if importlib.util.find_spec("sglang_router") else "builtin"


def engine_launch_spec(
    config: MilesConfig,
    engine: str,
    index: int,
    log_dir: Path,
    *,
    visible_devices: list[str] | None = None,
) -> dict:
    """EngineLaunchSpec fields of engine `index` of kind `engine` ("sglang" or "reference");
    `visible_devices`: the GPU ids of its bundles (`Placement.engine_devices`)."""
    assert config.backend is not None, "the schema adds the chosen backend's group (--seed)"
    extra_args = dict(config.engine.sglang_extra_args)
    if engine == "sglang" and config.cluster.colocate:
        # Without the memory saver, SGLang answers /release_memory_occupation with success and
        # keeps every byte: the colocated trainer would then run out of device memory.
        extra_args.setdefault("enable-memory-saver", True)
    return {
        "model_path": config.checkpoint.hf_checkpoint,
        "num_devices": config.cluster.rollout_num_gpus_per_engine,
        "dtype": config.engine.engine_dtype,
        "max_running_requests": config.engine.engine_max_running_requests,
        "mem_fraction_static": config.engine.engine_mem_fraction_static,
        "random_seed": config.backend.seed + index,
        "startup_timeout_s": config.engine.engine_startup_timeout_s,
        "log_path": str(log_dir / f"engine_{index}.log"),
        "extra_args": extra_args,
        "visible_devices": visible_devices,
        # Whatever makes the requests ask (--return-routed-experts, or R3 that sets it).
        "return_routed_experts": config.rollout.return_routed_experts,
        **lora_serving(config.backend),
    }


def served_adapter(config: MilesConfig) -> str | None:
    """The adapter every rollout request names (SGLang's `lora_path`): the trained one when the
    engines serve it beside the base (--lora-sync adapter); None when they serve merged weights."""
    backend = config.backend
    if backend is not None and backend.uses_lora and backend.lora_sync == "adapter":
        return LORA_ADAPTER_NAME
    return None


def check_adapter_serving(config: MilesConfig, engine: str) -> None:
    """SGLang's /unload_lora_adapter waits for the requests running with the adapter, and the
    fully-async loop pushes while requests wait paused in place: the push would never end."""
    if engine == "sglang" and served_adapter(config) and config.training.fully_async:
        raise ValueError(
            "--lora-sync adapter with --fully-async on SGLang engines: SGLang unloads an adapter "
            "only once its running requests finish, and a fully-async weight update pauses them "
            "in place; use --lora-sync merged with --fully-async"
        )


def lora_serving(backend: TrainerArgs) -> dict[str, Any]:
    """EngineLaunchSpec fields of an engine that serves the trained adapter (--lora-sync
    adapter): LoRA on, room for --lora-rank, the targeted modules (SGLang's `all` when PEFT
    picks them: all-linear, or a start adapter's own targets)."""
    if not (backend.uses_lora and backend.lora_sync == "adapter"):
        return {}
    targets = backend.target_module_names()
    if targets == ALL_LINEAR or backend.lora_adapter_path is not None:
        targets = ["all"]
    return {"enable_lora": True, "max_lora_rank": backend.lora_rank,
            "lora_target_modules": list(targets)}  # fmt: skip


class EngineFailedError(RuntimeError):
    """An engine failed a call of the rollout: the call's error and the end of its log."""


class EngineFleet:
    """The engines of one run: started once, restarted when lost, stopped by `dispose`."""

    def __init__(
        self,
        config: MilesConfig,
        placement: Placement | None,
        *,
        external_admin_key: str | None = None,
        cpu_threads: CpuThreads | None = None,
    ) -> None:
        """`external_admin_key`: the admin key of external engines (None: they take none);
        `cpu_threads`: the torch threads of each engine and teacher (None: inherited)."""
        self.config = config
        self.placement = placement
        self.cpu_threads = cpu_threads
        self.engine_actors: list[Any] = []
        self.engine_urls: list[str] = []
        self.router: RouterProcess | None = None
        self.pool: EnginePool | None = None
        self.supervisor: EngineSupervisor | None = None
        self.teachers: TeacherEngines | None = None  # --use-opd
        self._engine_kind = ""
        self._engine_specs: list[dict[str, Any]] = []
        # The engines this run launches answer admin calls (weights, memory, pause, abort) only
        # to holders of this key: the run's own clients and trainers. External engines have
        # the key their owner gave them.
        self.external = bool(config.cluster.rollout_external_engine_addrs)
        self._admin_key = external_admin_key if self.external else secrets.token_urlsafe(32)
        self._has_gpus = False
        self.start_seconds: float | None = None  # how long `start` took

    async def start(self) -> list[str]:
        """Launch every engine in its bundle, wait until all answer, set up the balancing."""
        if self.external:
            return await self._use_external_engines()
        config = self.config
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        engine = resolve_engine(config.cluster.rollout_engine, has_gpus)
        check_adapter_serving(config, engine)
        num_engines = len(self.placement.plan.engine_bundles) if self.placement else 1
        log_dir = Path(config.engine.engine_log_dir or Path(config.logging.output_dir) / "engines")
        log_dir.mkdir(parents=True, exist_ok=True)
        start, starts = time.perf_counter(), []
        self._engine_kind, self._has_gpus = engine, has_gpus
        for i in range(num_engines):
            actor = self._engine_actor(i, has_gpus)
            devices = self.placement.engine_devices(i) if self.placement else None
            spec = engine_launch_spec(config, engine, i, log_dir, visible_devices=devices)
            spec["admin_api_key"] = self._admin_key
            spec["cpu_threads"] = self.cpu_threads.engines[i] if self.cpu_threads else None
            if self.placement is not None and self.placement.bind_host is not None:
                spec["host"] = self.placement.bind_host  # else the actor's node address
            self.engine_actors.append(actor)
            self._engine_specs.append(spec)
            starts.append(actor.start.remote(engine, spec))
        logger.info("starting %d %s engine(s); logs in %s", num_engines, engine, log_dir)
        students, _ = await asyncio.wait_for(
            asyncio.gather(asyncio.gather(*starts), self._start_teachers(engine, has_gpus)),
            self._engine_start_bound_s,
        )
        self.engine_urls = list(students)
        for spec, url in zip(self._engine_specs, self.engine_urls, strict=True):
            spec["port"] = int(url.rsplit(":", 1)[1])  # a restart keeps the engine's URL
        self._start_balancing()
        if self.fault_tolerant:
            self._start_supervisor()
        self.start_seconds = time.perf_counter() - start
        return list(self.engine_urls)

    async def _use_external_engines(self) -> list[str]:
        """Check the engines of --rollout-external-engine-addrs and balance over them."""
        start = time.perf_counter()
        urls = self.config.cluster.external_engine_urls
        await check_external_engines(
            urls,
            hf_checkpoint=self.config.checkpoint.hf_checkpoint,
            admin_key=self._admin_key,
            timeout_s=self.config.engine.engine_startup_timeout_s,
        )
        self.engine_urls = urls
        self._start_balancing()
        if self.fault_tolerant:
            self._start_supervisor()
        self.start_seconds = time.perf_counter() - start
        return list(urls)

    async def _start_teachers(self, engine: str, has_gpus: bool) -> list[str]:
        """--use-opd: the teacher engines, launched beside the student's; their URLs."""
        if not self.config.distillation.use_opd:
            return []
        assert self._admin_key is not None, "--use-opd is refused with external engines"
        self.teachers = TeacherEngines(self.config, self.placement, admin_key=self._admin_key)
        threads = self.cpu_threads.teachers if self.cpu_threads else None
        return await self.teachers.start(
            engine, self._engine_specs[0], has_gpus=has_gpus, cpu_threads=threads
        )

    @property
    def fault_tolerant(self) -> bool:
        """--use-fault-tolerance, or by default: engines not colocated (one is enough: it is
        restarted while the rollout waits, where without fault tolerance its loss ends the run)."""
        choice = self.config.engine.use_fault_tolerance
        if choice is not None:
            return choice
        return bool(self.engine_urls) and not self.config.cluster.colocate

    def _engine_actor(self, index: int, has_gpus: bool) -> Any:
        colocate = self.config.cluster.colocate
        share = COLOCATED_ENGINE_SHARE if colocate else 1.0
        options: dict[str, Any] = {
            "num_cpus": share * self.config.cluster.cpus_per_bundle,
            "num_gpus": share if has_gpus else 0,
        }
        if self.placement is not None:
            options["scheduling_strategy"] = self.placement.engine_scheduling(index)
        return ray.remote(RolloutEngineActor).options(**options).remote()

    def _start_balancing(self) -> None:
        router_url = None
        if len(self.engine_urls) > 1 and resolve_router(self.config.engine.rollout_router) == (
            "sglang-router"
        ):
            log = Path(self.config.logging.output_dir) / "engines" / "router.log"
            self.router = RouterProcess(
                RouterConfig(worker_urls=self.engine_urls, policy="cache_aware"), log_path=log
            )
            self.router.start()
            router_url = self.router.url
            logger.info("sglang-router at %s fronts %d engines", router_url, len(self.engine_urls))
        self.pool = EnginePool(
            self.engine_urls,
            router_url=router_url,
            timeout_s=self.config.engine.rollout_request_timeout_s,
            per_token_s=self.config.engine.rollout_request_timeout_per_token_s,
            control_timeout_s=self.config.engine.engine_control_timeout_s,
            weights_timeout_s=self.config.engine.update_weights_timeout_s,
            fault_tolerant=self.fault_tolerant,
            api_key=self._admin_key,
            lora_name=served_adapter(self.config),
        )

    # -- fault tolerance (architecture.md: "Fault tolerance") -----------------------------------

    def _start_supervisor(self) -> None:
        assert self.pool is not None
        engine, training = self.config.engine, self.config.training
        config = FaultToleranceConfig(
            interval_s=engine.rollout_health_check_interval_s,
            timeout_s=engine.rollout_health_check_timeout_s,
            max_restarts=engine.max_engine_restarts,
            needs_weights=not training.debug_rollout_only,
        )
        router = self.router
        # An external engine is not ours to restart: a lost one stays lost.
        restart = None if self.external else self._restart_engine
        self.supervisor = EngineSupervisor(
            self.pool, config, restart=restart, log_tail=self.engine_log_tail,
            on_remove=(lambda url: asyncio.to_thread(router.remove_worker, url)) if router else None,
            on_return=(lambda url: asyncio.to_thread(router.add_worker, url)) if router else None,
        )  # fmt: skip
        self.supervisor.start()
        logger.info("fault tolerance: /health every %.0f s (bound %.0f s), %s",
                    config.interval_s, config.timeout_s,
                    "external engines: a lost one is not restarted" if self.external
                    else f"{config.max_restarts} restart(s) per engine")  # fmt: skip

    async def _restart_engine(self, index: int) -> None:
        """Stop what is left of engine `index` and start it again in its bundle, at its URL."""
        actor = self.engine_actors[index]
        try:
            await asyncio.wait_for(actor.shutdown.remote(grace_s=2.0), 60)
        except Exception as err:  # the actor is gone or stuck too: a new one in the same bundle
            logger.warning(
                "engine %d's actor did not stop its engine (%s); replacing it", index, err
            )
            ray.kill(actor)
            actor = self._engine_actor(index, self._has_gpus)
            self.engine_actors[index] = actor
        await asyncio.wait_for(
            actor.start.remote(self._engine_kind, self._engine_specs[index]),
            self._engine_start_bound_s,
        )

    @property
    def _engine_start_bound_s(self) -> float:
        """An engine actor's start waits at most --engine-startup-timeout-s for its server; a
        minute more covers the actor itself (launching the process, reporting the URL)."""
        return self.config.engine.engine_startup_timeout_s + 60.0

    def engine_log_tail(self, index: int, lines: int = 20) -> str:
        """The last lines of engine `index`'s log file (its output across restarts)."""
        if self.external:
            return "  (an external engine: its log is wherever it was started)"
        path = self._engine_specs[index]["log_path"]
        try:
            text = file_tail(path, lines)
        except OSError as err:
            return f"(no log at {path}: {err})"
        return "\n".join(f"  {line}" for line in text.splitlines()) or "  (empty)"

    def engines_awaiting_weights(self) -> list[str]:
        """Restarted engines that serve again once the trainers pushed them the weights."""
        return self.supervisor.awaiting_weights() if self.supervisor else []

    async def recover_engines(self) -> list[str]:
        """Before a weight update: check every engine now, wait until none is restarting
        (bounded by --engine-startup-timeout-s); the engines then awaiting weights."""
        if self.supervisor is None:
            return []
        await self.supervisor.check_now()
        return await self.supervisor.wait_restarted(self.config.engine.engine_startup_timeout_s)

    async def admit_engines(self, urls: list[str], weight_version: int | None) -> None:
        """Put restarted engines back in service once each reports `weight_version` (the
        trainers' version after pushing it to them; None: the checkpoint's weights)."""
        assert self.supervisor is not None, "admit_engines() needs fault tolerance"
        expected = None if weight_version is None else str(weight_version)
        for url in urls:
            async with EngineClient(url, max_retries=0) as client:
                found = (await client.get_model_info()).get("weight_version")
            if expected is not None and str(found) != expected:
                raise RuntimeError(
                    f"restarted engine {url} reports weight version {found!r} after the weight "
                    f"push, not {expected!r}: it would generate with other weights than the rest"
                )
        await self.supervisor.admit(urls)

    async def weight_versions(self) -> dict[str, str | None]:
        """The weight version each engine in service reports (`/get_model_info`). With fault
        tolerance, an engine that does not answer is left out: it is lost, and its restart
        pushes it the weights before it serves again."""
        serving = self.pool.serving() if self.pool is not None else list(self.engine_urls)

        async def version(url: str) -> str | None:
            async with EngineClient(url, max_retries=0) as client:
                found = (await client.get_model_info()).get("weight_version")
            return None if found is None else str(found)

        answers = await asyncio.gather(*map(version, serving), return_exceptions=True)
        versions = {}
        for url, answer in zip(serving, answers, strict=True):
            if isinstance(answer, BaseException):
                if self.supervisor is None or not isinstance(answer, Exception):
                    raise answer
                logger.warning("engine %s gave no weight version (%s); it is left to its restart",
                               url, answer)  # fmt: skip
                continue
            versions[url] = answer
        return versions

    def engines_lost_for_good(self) -> list[str]:
        """External engines lost during the run: the trainers push weights to the others."""
        return self.supervisor.lost_for_good() if self.supervisor else []

    def fault_metrics(self) -> dict[str, float]:
        return self.supervisor.metrics() if self.supervisor else {}

    def explain(self, err: EngineError) -> RuntimeError:
        """An engine's failure, with the end of its log (the engine's own words)."""
        url = err.url.rstrip("/")
        if url not in self.engine_urls:
            return err
        index = self.engine_urls.index(url)
        if self.external:
            return EngineFailedError(f"external engine {index} at {url} failed: {err}")
        return EngineFailedError(
            f"engine {index} at {url} failed: {err}\nthe end of its log "
            f"({self._engine_specs[index]['log_path']}):\n{self.engine_log_tail(index)}"
        )

    async def engine_pids(self) -> list[int]:
        """Process ids of the engine servers (for monitoring, and tests that check shutdown)."""
        return list(await asyncio.gather(*[a.pid.remote() for a in self.engine_actors]))

    async def engine_processes(self) -> dict[str, tuple[int, str]]:
        """{"engine_<i>": (server pid, Ray node id)} of the engines running now."""
        pids = await asyncio.gather(*[a.pid.remote() for a in self.engine_actors])
        nodes = await asyncio.gather(*[a.node_id.remote() for a in self.engine_actors])
        return {
            f"engine_{i}": (pid, node)
            for i, (pid, node) in enumerate(zip(pids, nodes, strict=True))
            if pid is not None
        }

    @property
    def admin_key(self) -> str | None:
        """The admin key of these engines (for the trainers' weight pushes; None: external
        engines that take none)."""
        return self._admin_key

    async def dispose(self) -> None:
        """Stop the supervisor, the router and every engine; nothing started here outlives this
        call. External engines keep running: no process of theirs is the run's."""
        if self.supervisor is not None:
            await self.supervisor.stop()
            self.supervisor = None
        if self.pool is not None:
            await self.pool.aclose()
            self.pool = None
        if self.teachers is not None:
            await self.teachers.dispose()
            self.teachers = None
        if self.router is not None:
            self.router.shutdown()
            self.router = None
        if self.engine_actors:
            stops = asyncio.gather(*[actor.shutdown.remote() for actor in self.engine_actors])
            try:
                await asyncio.wait_for(stops, 60)
            except Exception as err:  # a hung or dead actor: killed below with the rest
                logger.warning("stopping the engines: %s", describe(err))
            for actor in self.engine_actors:
                ray.kill(actor)
            self.engine_actors = []
