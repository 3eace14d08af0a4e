"""`RolloutManager`: the Ray actor that owns the rollout side of a run.

It starts the engines (one `RolloutEngineActor` per engine, in the engine's placement bundle),
fronts them with sglang-router or the built-in least-loaded balancer, and per rollout runs:
rollout function -> rewards -> reward shaping -> columnar train data, one shard per data-parallel
rank, put in the Ray object store. It also evaluates, offloads/onloads engines, saves the
data-source state, and `dispose()` stops every process it started.

Start-up order: `start_engines` launches the engine processes first, and while they load their
model `load_data` reads the tokenizer and the prompts. No heavy import is made at the top of this
module, so the engines' launch waits for none: the tokenizer loads without torch where it can
(`miles.utils.tokenizers`), and torch (for the train data) is imported in a thread while the first
rollout generates.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

import ray
from miles.backends.sglang_utils.client import EngineClient, EngineError
from miles.backends.sglang_utils.router import RouterConfig, RouterProcess
from miles.backends.sglang_utils.server_process import file_tail
from miles.backends.training_utils.import_path import load_function
from miles.config.miles_config import MilesConfig
from miles.ray.engine_actor import RolloutEngineActor
from miles.ray.placement import Placement
from miles.ray.placement_plan import COLOCATED_ENGINE_SHARE
from miles.ray.teacher_engines import TeacherEngines
from miles.rollout.data_source import DataSourceConfig, PromptDataset, RolloutDataSource
from miles.rollout.engine_pool import EnginePool
from miles.rollout.engine_supervisor import EngineSupervisor, FaultToleranceConfig
from miles.rollout.fully_async import FullyAsyncConfig, FullyAsyncRollouts
from miles.rollout.generate import (
    RolloutConfig,
    RolloutOutput,
    generate_groups,
    group_runner,
    sample_generator,
)
from miles.rollout.rewards import RewardHub
from miles.rollout.rewards.config import BUILTIN_RM_TYPES
from miles.rollout.rollout_config import ROLLOUT_FUNCTION_FLAG
from miles.utils.checkpoint_layout import atomic_write_text, latest_rollout_id, rollout_state_path
from miles.utils.failures import describe
from miles.utils.hf_config import hf_config_value
from miles.utils.plugins import ROLLOUT_ENGINES, installed_plugins
from miles.utils.tokenizers import load_tokenizer

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
    }


class EngineFailedError(RuntimeError):
    """An engine failed a call of the rollout: the call's error and the end of its log."""


@dataclasses.dataclass(frozen=True)
class _Prompts:
    """What `load_data` read: the training prompts, served in order, and the eval prompts."""

    dataset: PromptDataset
    source: RolloutDataSource
    eval_sources: dict[str, tuple[PromptDataset, DataSourceConfig]]


class RolloutManager:
    """Everything between "rollout N starts" and "train data of rollout N is in the object store".

    Runs as a Ray actor (`ray.remote(RolloutManager)`); async methods share one event loop, so
    generation, evaluation and control calls never race on the engines' clients.
    """

    def __init__(self, config: MilesConfig, placement: Placement | None, *, dp_size: int):
        self.config = config
        self.placement = placement
        self.dp_size = dp_size
        self.reward_hub = RewardHub(config.reward)
        # The built-in rollout is this flag's default: it is loaded and called like a custom one.
        self.rollout_function = load_function(
            config.rollout.rollout_function_path, ROLLOUT_FUNCTION_FLAG
        )
        self._data: _Prompts | None = None
        self.engine_actors: list[Any] = []
        self.engine_urls: list[str] = []
        self.router: RouterProcess | None = None
        self.pool: EnginePool | None = None
        self.supervisor: EngineSupervisor | None = None
        self.teachers: TeacherEngines | None = None  # --use-opd
        self._engine_kind = ""
        self._engine_specs: list[dict[str, Any]] = []
        # The engines this run launches answer admin calls (weights, memory, pause, abort) only
        # to holders of this key: the run's own clients and trainers.
        self._admin_key = secrets.token_urlsafe(32)
        self._has_gpus = False
        self.startup_seconds: dict[str, float] = {}
        self._reward_metrics: dict[str, float] = {}
        self._reward_failures = self._reward_scored = 0
        self._fully_async: FullyAsyncRollouts | None = None
        self._fully_async_state: dict[str, Any] | None = None  # from --load, until it starts
        self._train_data_import: asyncio.Future | None = None

    async def load_data(self) -> int:
        """Read the tokenizer, the prompts and the eval prompts; returns the number of prompts.

        Called once, after `start_engines`, whose engines load their model meanwhile. The reading
        runs in a thread: the event loop stays free to see the engines answer."""
        if self._data is None:
            start = time.perf_counter()
            self._data = await asyncio.to_thread(self._read_prompts)
            self.startup_seconds["data"] = time.perf_counter() - start
        return len(self._data.dataset)

    def _read_prompts(self) -> _Prompts:
        # Seconds of imports (see the module docstring); the rollout functions share it.
        tokenizer = load_tokenizer(self.config.checkpoint.hf_checkpoint)
        dataset = PromptDataset(self.config.data, tokenizer, **self._row_checks())
        return _Prompts(
            dataset=dataset,
            source=RolloutDataSource(
                dataset,
                self.config.data,
                n_samples_per_prompt=self.config.rollout.n_samples_per_prompt,
            ),
            eval_sources=self._eval_sources(tokenizer),
        )

    @property
    def data_source(self) -> RolloutDataSource:
        return self._loaded().source

    @property
    def eval_sources(self) -> dict[str, tuple[PromptDataset, DataSourceConfig]]:
        return self._loaded().eval_sources

    def _loaded(self) -> _Prompts:
        if self._data is None:
            raise RuntimeError("the rollout manager has no prompts yet: call load_data() first")
        return self._data

    def _eval_sources(self, tokenizer: Any) -> dict[str, tuple[PromptDataset, DataSourceConfig]]:
        sources = {}
        for name, path in self.config.eval.eval_datasets.items():
            data_config = DataSourceConfig(
                **{
                    **vars(self.config.data),
                    "prompt_data": path,
                    "rollout_shuffle": False,
                }
            )
            dataset = PromptDataset(data_config, tokenizer, **self._row_checks())
            sources[name] = (dataset, data_config)
        return sources

    def _row_checks(self) -> dict[str, Any]:
        """What PromptDataset checks each row against: labels, where the reward reads them,
        and the model's context length (from its config.json)."""
        context = hf_config_value(self.config.checkpoint.hf_checkpoint, "max_position_embeddings")
        return {
            "labels_required": self.config.reward.rm_type in BUILTIN_RM_TYPES,
            "context_length": int(context) if context else None,
        }

    # -- engines -----------------------------------------------------------------------------

    async def start_engines(self) -> list[str]:
        """Launch every engine in its bundle, wait until all answer, set up the balancing."""
        config = self.config
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        engine = resolve_engine(config.cluster.rollout_engine, has_gpus)
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
        self.startup_seconds["engines"] = time.perf_counter() - start
        return list(self.engine_urls)

    async def _start_teachers(self, engine: str, has_gpus: bool) -> list[str]:
        """--use-opd: the teacher engines, launched beside the student's; their URLs."""
        if not self.config.distillation.use_opd:
            return []
        self.teachers = TeacherEngines(self.config, self.placement, admin_key=self._admin_key)
        return await self.teachers.start(engine, self._engine_specs[0], has_gpus=has_gpus)

    def where(self) -> str:
        """ "pid P on node A": where this manager runs (for messages about it)."""
        return f"pid {os.getpid()} on node {ray.util.get_node_ip_address()}"

    def engine_admin_key(self) -> str:
        """The admin key of the engines this manager launched (for the trainers' weight pushes)."""
        return self._admin_key

    def uses_fault_tolerance(self) -> bool:
        return self.fault_tolerant

    @property
    def fault_tolerant(self) -> bool:
        """--use-fault-tolerance, or by default: more than one engine (not colocated)."""
        choice = self.config.engine.use_fault_tolerance
        if choice is not None:
            return choice
        return len(self.engine_urls) > 1 and not self.config.cluster.colocate

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
        self.supervisor = EngineSupervisor(
            self.pool, config, restart=self._restart_engine, log_tail=self.engine_log_tail,
            on_remove=(lambda url: asyncio.to_thread(router.remove_worker, url)) if router else None,
            on_return=(lambda url: asyncio.to_thread(router.add_worker, url)) if router else None,
        )  # fmt: skip
        self.supervisor.start()
        logger.info("fault tolerance: /health every %.0f s (bound %.0f s), %d restart(s) per engine",
                    config.interval_s, config.timeout_s, config.max_restarts)  # fmt: skip

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

    def fault_metrics(self) -> dict[str, float]:
        return self.supervisor.metrics() if self.supervisor else {}

    def _explain_engine_error(self, err: EngineError) -> RuntimeError:
        """An engine's failure, with the end of its log (the engine's own words)."""
        url = err.url.rstrip("/")
        if url not in self.engine_urls:
            return err
        index = self.engine_urls.index(url)
        return EngineFailedError(
            f"engine {index} at {url} failed: {err}\nthe end of its log "
            f"({self._engine_specs[index]['log_path']}):\n{self.engine_log_tail(index)}"
        )

    async def engine_pids(self) -> list[int]:
        """Process ids of the engine servers (for monitoring, and tests that check shutdown)."""
        return list(await asyncio.gather(*[a.pid.remote() for a in self.engine_actors]))

    def get_engine_urls(self) -> list[str]:
        return list(self.engine_urls)

    def get_teacher_urls(self) -> list[str]:
        """The teacher engines' URLs (--use-opd); none without."""
        return list(self.teachers.urls) if self.teachers else []

    def get_startup_seconds(self) -> dict[str, float]:
        """How long `start_engines` and `load_data` took (each measured here, where it ran)."""
        return dict(self.startup_seconds)

    # -- one rollout -------------------------------------------------------------------------

    async def generate(self, rollout_id: int) -> dict[str, Any]:
        """Generate and score rollout `rollout_id`; returns {"data": [ObjectRef per DP rank],
        "metrics": {...}}. Rank r trains on `data[r]`."""
        start = time.perf_counter()
        self._start_train_data_import()
        self._reward_metrics = {}
        self._reward_failures = self._reward_scored = 0
        try:
            groups, metrics = await self._rollout(rollout_id)
        except EngineError as err:
            raise self._explain_engine_error(err) from err
        unscored = [g for g in groups if any(s.reward is None for s in g)]
        if unscored:  # a custom rollout function may leave scoring to the hub
            await self._score(unscored)
        result = await self._train_data(groups, metrics)
        result["metrics"]["rollout/time_s"] = time.perf_counter() - start
        return result

    async def _train_data(
        self, groups: list[list[Any]], metrics: dict[str, float]
    ) -> dict[str, Any]:
        """Scored groups as train data: {"data": [ObjectRef per DP rank], "metrics": {...}}.
        Every way of making a rollout (one rollout at a time, or taken from the fully-async
        buffer) ends here."""
        train_data = await self._train_data_module()
        if self.teachers is not None:  # --use-opd: the teacher's log-prob of every response token
            metrics = {**metrics, **await self.teachers.score(groups)}
        shards = train_data.build_train_data(groups, self.config.algorithm, dp_size=self.dp_size)
        metrics = {**metrics, **train_data.rollout_metrics(groups), **self._reward_metrics}
        return {"data": [ray.put(shard) for shard in shards], "metrics": metrics}

    def _start_train_data_import(self) -> None:
        """Start importing `miles.rollout.train_data` (torch) in a thread, once.

        Nothing of this process needs torch before a rollout's end (the tokenizer loads without
        it), so the import runs while the rollout generates, when the engines work on other
        cores, instead of during start-up, when every process of the run imports at once."""
        if self._train_data_import is None:
            self._train_data_import = asyncio.ensure_future(
                asyncio.to_thread(importlib.import_module, "miles.rollout.train_data")
            )

    async def _train_data_module(self) -> Any:
        self._start_train_data_import()
        assert self._train_data_import is not None
        return await self._train_data_import

    async def _rollout(self, rollout_id: int) -> tuple[list[list[Any]], dict[str, float]]:
        assert self.pool is not None, "start_engines() before generate()"
        result = self.rollout_function(
            rollout_id,
            pool=self.pool,
            data_source=self.data_source,
            score_groups=self._score,
            config=self.config,
        )
        if asyncio.iscoroutine(result):
            result = await result
        if isinstance(result, RolloutOutput):
            return result.groups, dict(result.metrics)
        return result, {}

    async def _score(self, groups: list[list[Any]]) -> Any:
        report = await self.reward_hub.score_groups(groups)
        self._reward_failures += report.failures
        self._reward_scored += len(report.rewards)
        self._reward_metrics["reward/failures"] = float(self._reward_failures)
        self._reward_metrics["reward/failure_rate"] = self._reward_failures / max(
            1, self._reward_scored
        )
        return report

    # -- evaluation --------------------------------------------------------------------------

    async def eval(self, rollout_id: int) -> dict[str, float]:
        """Mean reward and pass@k on every --eval-prompt-data dataset (each prompt once).

        Each held-out sample is made as the rollout function makes its own where it says how
        (`generate.sample_generator`: the tool rollout's multi-turn exchange with the tools),
        else by --custom-generate-function-path, else by one /generate call."""
        assert self.pool is not None, "start_engines() before eval()"
        self._start_train_data_import()

        metrics: dict[str, float] = {}
        generate_fn = await sample_generator(self.rollout_function, self.config)
        for name, (dataset, data_config) in self.eval_sources.items():
            # A fresh source per evaluation: every prompt once, in file order.
            source = RolloutDataSource(
                dataset,
                data_config,
                n_samples_per_prompt=self.config.eval.n_samples_per_eval_prompt,
            )
            eval_config = self._eval_rollout_config(len(dataset))
            try:
                output = await generate_groups(
                    self.pool, source, self.reward_hub.score_groups, eval_config,
                    rollout_id=rollout_id, generate_fn=generate_fn,
                )  # fmt: skip
            except EngineError as err:
                raise self._explain_engine_error(err) from err
            train_data = await self._train_data_module()
            metrics.update(train_data.eval_metrics(output.groups, name))
        return metrics

    def _eval_rollout_config(self, num_prompts: int) -> RolloutConfig:
        rollout, eval_ = self.config.rollout, self.config.eval
        return RolloutConfig(
            rollout_batch_size=num_prompts,
            n_samples_per_prompt=eval_.n_samples_per_eval_prompt,
            rollout_max_response_len=eval_.eval_max_response_len
            or rollout.rollout_max_response_len,
            rollout_temperature=(
                eval_.eval_temperature
                if eval_.eval_temperature is not None
                else rollout.rollout_temperature
            ),
            rollout_top_p=rollout.rollout_top_p,
            rollout_top_k=rollout.rollout_top_k,
            rollout_stop=rollout.rollout_stop,
            rollout_stop_token_ids=rollout.rollout_stop_token_ids,
            rollout_concurrency=rollout.rollout_concurrency,
            custom_generate_function_path=rollout.custom_generate_function_path,
        )

    # -- memory, checkpoints, shutdown ---------------------------------------------------------

    async def offload(self) -> None:
        """Free the engines' device memory (weights and KV cache) for colocated training."""
        assert self.pool is not None
        await self.pool.release_memory_occupation()

    async def onload(self, tags: list[str] | None = None) -> None:
        assert self.pool is not None
        await self.pool.resume_memory_occupation(tags)

    def save(self, rollout_id: int) -> Path:
        """Write the data-source state of `rollout_id` (before the backend's checkpoint; the
        pointer file written after both makes the checkpoint count as complete)."""
        save_dir = self.config.checkpoint.save
        assert save_dir, "save() needs --save"
        path = rollout_state_path(save_dir, rollout_id)
        state: dict[str, Any] = {
            "rollout_id": rollout_id,
            "data_source": self.data_source.state_dict(),
        }
        if self._fully_async is not None:
            state["fully_async"] = self._fully_async.state_dict()
        atomic_write_text(path, json.dumps(state))
        return path

    def load(self, load_dir: str | None = None) -> int | None:
        """Restore the data-source state of the latest complete checkpoint; its rollout id."""
        load_dir = load_dir or self.config.checkpoint.load
        rollout_id = latest_rollout_id(load_dir) if load_dir else None
        if rollout_id is None:
            return None
        path = rollout_state_path(load_dir, rollout_id)
        if not path.is_file():
            raise FileNotFoundError(
                f"checkpoint {rollout_id} in {load_dir} has no rollout state ({path}); it was "
                "written by another tool or its save was interrupted: resume from an earlier one"
            )
        state = json.loads(path.read_text())
        self.data_source.load_state_dict(state["data_source"])
        self._fully_async_state = state.get("fully_async")
        logger.info("resumed the data source at rollout %d from %s", rollout_id, path)
        return rollout_id

    async def dispose(self) -> None:
        """Stop the router and every engine; nothing started here outlives this call."""
        if self._fully_async is not None:
            await self._fully_async.stop()
            self._fully_async = None
        if self.supervisor is not None:
            await self.supervisor.stop()
            self.supervisor = None
        if self.pool is not None:
            await self.pool.aclose()
            self.pool = None
        await self.reward_hub.aclose()
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

    # -- fully-async generation (miles.rollout.fully_async) ---------------------------------

    async def start_fully_async(self, weight_version: int) -> None:
        """Start generating in the background with the engines at `weight_version`, from the
        buffer of the resumed checkpoint if there is one."""
        assert self.pool is not None, "start_engines() before start_fully_async()"
        training, rollout = self.config.training, self.config.rollout
        assert training.fully_async_buffer_groups is not None, "derived by the config"
        config = FullyAsyncConfig(
            max_weight_staleness=training.max_weight_staleness,
            buffer_groups=training.fully_async_buffer_groups,
            unused_samples_handler=training.async_unused_samples_handler,
            partial_rollout=rollout.partial_rollout,
            mask_offpolicy=rollout.mask_offpolicy_in_partial_rollout,
        )
        run_group = group_runner(
            self.pool, self.data_source, self._score, rollout,
            generate_fn=await sample_generator(self.rollout_function, self.config),
        )  # fmt: skip
        buffer = FullyAsyncRollouts(
            run_group, self.data_source, self.pool, config, weight_version=weight_version
        )
        if self._fully_async_state is not None:
            buffer.load_state_dict(self._fully_async_state)
            self._fully_async_state = None
        self._fully_async = buffer
        buffer.start()

    async def take_rollout(self, rollout_id: int) -> dict[str, Any]:
        """Rollout `rollout_id` from the fully-async buffer: the oldest --rollout-batch-size
        ready groups within the staleness bound, as `generate` returns a rollout."""
        assert self._fully_async is not None, "start_fully_async() before take_rollout()"
        start = time.perf_counter()
        try:
            groups, metrics = await self._fully_async.take(self.config.rollout.rollout_batch_size)
        except EngineError as err:
            raise self._explain_engine_error(err) from err
        result = await self._train_data(groups, metrics)
        result["metrics"]["rollout/time_s"] = time.perf_counter() - start
        # Scoring runs all the time: each rollout reports what was scored since the last one.
        self._reward_metrics = {}
        self._reward_failures = self._reward_scored = 0
        return result

    async def pause_for_weight_update(self) -> None:
        """Nothing in flight on return: the groups finished on the old weights, or (partial
        rollout) were aborted to continue on the new ones."""
        assert self._fully_async is not None, "start_fully_async() first"
        try:
            await self._fully_async.pause_for_update()
        except EngineError as err:
            raise self._explain_engine_error(err) from err

    async def resume_after_weight_update(self, weight_version: int) -> None:
        assert self._fully_async is not None, "start_fully_async() first"
        await self._fully_async.resume_after_update(weight_version)
