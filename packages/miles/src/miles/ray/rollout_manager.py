"""`RolloutManager`: the Ray actor that owns the rollout side of a run.

It holds the run's engines (`EngineFleet`: start, balance, supervise, stop), its prompts and its
rollout (`miles.rollout.contract.Rollout`, from --rollout-function-path), and per rollout runs:
rollout -> rewards -> reward shaping -> columnar train data, one shard per data-parallel rank, put
in the Ray object store. It also evaluates, offloads/onloads engines, saves the data-source state
and runs fully-async generation.

Start-up order: `start_engines` launches the engine processes first, and while they load their
model `load_data` reads the tokenizer and the prompts. No heavy import is made at the top of this
module, so the engines' launch waits for none: the tokenizer loads without torch where it can
(`miles.utils.tokenizers`), and torch (for the train data) is imported in a thread while the first
rollout generates (`_import_train_data`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import ray
from miles.backends.sglang_utils.client import EngineError
from miles.config.eval_config import EvalDatasetConfig
from miles.config.miles_config import MilesConfig
from miles.ray.cpu_threads import CpuThreads
from miles.ray.engine_fleet import EngineFleet
from miles.ray.kept_train_data import KeptTrainData
from miles.ray.placement import Placement
from miles.rollout.context import DataSource, RolloutContext, ScoreGroups
from miles.rollout.data_source import DataSourceConfig, PromptDataset, RolloutDataSource
from miles.rollout.engine_pool import EnginePool
from miles.rollout.fully_async import FullyAsyncConfig, FullyAsyncRollouts
from miles.rollout.group_loop import group_runner, run_groups
from miles.rollout.loader import load_rollout
from miles.rollout.mixture import MixtureSource, source_config, source_reward
from miles.rollout.rewards import RewardHub
from miles.rollout.rewards.config import BUILTIN_RM_TYPES, RewardConfig
from miles.rollout.rewards.hub import (
    MAX_FAILURE_MESSAGES,
    RewardTally,
    check_failure_rate,
    reward_tally_metrics,
)
from miles.rollout.rollout_config import RolloutConfig
from miles.utils.checkpoint_layout import atomic_write_text, latest_rollout_id, rollout_state_path
from miles.utils.hf_config import hf_config_value
from miles.utils.tokenizers import load_processor, load_tokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EvalSource:
    """One held-out dataset as `load_data` read it: its settings and its prompts."""

    config: EvalDatasetConfig
    prompts: PromptDataset


@dataclasses.dataclass(frozen=True)
class _Prompts:
    """What `load_data` read: the tokenizer, the training prompts, served in order, and the eval
    prompts."""

    tokenizer: Any
    size: int
    """Prompts to train on (of every source of a mixture)."""
    names_rewards: bool
    """Some rows (or a mixture's sources) name their own reward: rollouts report by reward."""
    source: RolloutDataSource
    eval_sources: list[EvalSource]


class RolloutManager:
    """Everything between "rollout N starts" and "train data of rollout N is in the object store".

    Runs as a Ray actor (`ray.remote(RolloutManager)`); async methods share one event loop, so
    generation, evaluation and control calls never race on the engines' clients.
    """

    def __init__(
        self,
        config: MilesConfig,
        placement: Placement | None,
        *,
        dp_size: int,
        external_admin_key: str | None = None,
        cpu_threads: CpuThreads | None = None,
    ):
        """`external_admin_key`: the admin key of --rollout-external-engine-addrs' engines;
        `cpu_threads`: the engines' torch threads (None: they inherit this process's)."""
        self.config = config
        self.dp_size = dp_size
        self.reward_hub = RewardHub(config.reward)
        # A held-out dataset with its own reward settings (--eval-config) has its own hub.
        self.eval_reward_hubs = {
            d.name: self.reward_hub if d.reward == config.reward else RewardHub(d.reward)
            for d in config.eval.eval_datasets
        }
        # The built-in rollout is this flag's default: it is loaded and called like a custom one.
        self.rollout = load_rollout(config.rollout, run_config=config)
        self.engines = EngineFleet(
            config, placement, external_admin_key=external_admin_key, cpu_threads=cpu_threads
        )
        self._data: _Prompts | None = None
        self.startup_seconds: dict[str, float] = {}
        self._reset_reward_tallies()
        self._fully_async: FullyAsyncRollouts | None = None
        self._fully_async_state: dict[str, Any] | None = None  # from --load, until it starts
        self._train_data_import: asyncio.Future[ModuleType] | None = None
        self._profiling: Any = None  # a RolloutProfiling window, between start and stop
        self._kept: KeptTrainData | None = None  # with trainer restarts: the rollouts to replay

    async def load_data(self) -> int:
        """Read the tokenizer, the prompts and the eval prompts; returns the number of prompts.

        Called once, after `start_engines`, whose engines load their model meanwhile. The reading
        runs in a thread: the event loop stays free to see the engines answer."""
        if self._data is None:
            start = time.perf_counter()
            self._data = await asyncio.to_thread(self._read_prompts)
            self.startup_seconds["data"] = time.perf_counter() - start
        return self._data.size

    def _read_prompts(self) -> _Prompts:
        # Seconds of imports (see the module docstring); the rollout functions share it.
        tokenizer = load_tokenizer(self.config.checkpoint.hf_checkpoint)
        mixture = self._read_mixture(tokenizer)
        if mixture is None:
            run_reward = self.config.reward
            dataset = PromptDataset(self.config.data, tokenizer, **self._row_checks(run_reward))
            self.reward_hub.check_rewards(dataset.own_rewards)
            names_rewards = bool(dataset.own_rewards)
        else:
            dataset = mixture[0][1]
            names_rewards = any(s.reward or d.own_rewards for s, d in mixture)
        return _Prompts(
            tokenizer=tokenizer,
            size=sum(len(d) for _, d in mixture) if mixture else len(dataset),
            names_rewards=names_rewards,
            source=RolloutDataSource(
                dataset,
                self.config.data,
                n_samples_per_prompt=self.config.rollout.n_samples_per_prompt,
                mixture=mixture,
            ),
            eval_sources=self._eval_sources(tokenizer),
        )

    def _read_mixture(self, tokenizer: Any) -> list[tuple[MixtureSource, PromptDataset]] | None:
        """Each source of a --prompt-data mixture file, read with its own columns and checked
        against its own reward (rows naming none are scored with the source's)."""
        sources = self.config.data.mixture
        if sources is None:
            return None
        read = []
        for source in sources:
            run_reward = self.config.reward
            checks = self._row_checks(run_reward)
            reward = source_reward(source, run_reward, self.config.data.prompt_data)
            if reward is not None:
                checks["reward"] = reward.config(run_reward)
                self.reward_hub.check_rewards({reward: f"source {source.name!r}"})
            dataset = PromptDataset(source_config(self.config.data, source), tokenizer, **checks)
            self.reward_hub.check_rewards(dataset.own_rewards)
            read.append((source, dataset))
        return read

    @property
    def data_source(self) -> RolloutDataSource:
        return self._loaded().source

    @property
    def eval_sources(self) -> list[EvalSource]:
        return self._loaded().eval_sources

    def _loaded(self) -> _Prompts:
        if self._data is None:
            raise RuntimeError("the rollout manager has no prompts yet: call load_data() first")
        return self._data

    def _eval_sources(self, tokenizer: Any) -> list[EvalSource]:
        sources = []
        for d in self.config.eval.eval_datasets:
            prompts = PromptDataset(d.data, tokenizer, **self._row_checks(d.reward))
            self.eval_reward_hubs[d.name].check_rewards(
                prompts.own_rewards
            )  # rows naming their own
            sources.append(EvalSource(d, prompts))
        return sources

    def _row_checks(self, reward: RewardConfig) -> dict[str, Any]:
        """What PromptDataset checks each row against: labels, where `reward` reads them,
        and the model's context length (from its config.json)."""
        checkpoint = self.config.checkpoint.hf_checkpoint
        context = hf_config_value(checkpoint, "max_position_embeddings")
        return {
            "labels_required": reward.rm_type in BUILTIN_RM_TYPES,
            "context_length": int(context) if context else None,
            "reward": reward,
            # Read only for data with images (--multimodal-keys); a VLM's processor loads in ms.
            "processor": load_processor(checkpoint) if self._reads_images() else None,
        }

    def _reads_images(self) -> bool:
        data = [self.config.data, *(d.data for d in self.config.eval.eval_datasets)]
        return any(d.image_key is not None for d in data)

    # -- engines (miles.ray.engine_fleet) ------------------------------------------------------

    async def start_engines(self) -> list[str]:
        """Launch every engine in its bundle, wait until all answer, set up the balancing."""
        urls = await self.engines.start()
        assert self.engines.start_seconds is not None
        self.startup_seconds["engines"] = self.engines.start_seconds
        return urls

    @property
    def pool(self) -> EnginePool:
        assert self.engines.pool is not None, "start_engines() first"
        return self.engines.pool

    def where(self) -> str:
        """ "pid P on node A": where this manager runs (for messages about it)."""
        return f"pid {os.getpid()} on node {ray.util.get_node_ip_address()}"

    def engine_admin_key(self) -> str | None:
        """The admin key of the engines (for the trainers' weight pushes): the one this manager
        gave the engines it launched, or external engines' own (None: they take none)."""
        return self.engines.admin_key

    def uses_fault_tolerance(self) -> bool:
        return self.engines.fault_tolerant

    def engines_awaiting_weights(self) -> list[str]:
        """Restarted engines that serve again once the trainers pushed them the weights."""
        return self.engines.engines_awaiting_weights()

    async def recover_engines(self) -> list[str]:
        """Before a weight update: the engines awaiting weights once none is restarting."""
        return await self.engines.recover_engines()

    def engines_lost_for_good(self) -> list[str]:
        """External engines lost during the run (never restarted)."""
        return self.engines.engines_lost_for_good()

    async def admit_engines(self, urls: list[str], weight_version: int | None) -> None:
        """Put restarted engines back in service once each reports `weight_version`."""
        await self.engines.admit_engines(urls, weight_version)

    def fault_metrics(self) -> dict[str, float]:
        return self.engines.fault_metrics()

    async def engine_weight_versions(self) -> dict[str, str | None]:
        """The weight version each serving engine reports (after a trainer restart, the driver
        checks that they still hold the version it pushed last)."""
        return await self.engines.weight_versions()

    # -- the train data a restarted train group replays (miles.ray.kept_train_data) ------------

    async def keep_train_data(self, rollout_id: int, data: list[ray.ObjectRef]) -> None:
        """Write rollout `rollout_id`'s train data (its shards' references) to disk."""
        if self._kept is None:
            assert self.config.checkpoint.save, "trainer restarts need --save"
            self._kept = KeptTrainData(self.config.checkpoint.save)
        shards = await asyncio.gather(*data)
        await asyncio.to_thread(self._kept.keep, rollout_id, list(shards))

    async def kept_train_data(self, rollout_id: int) -> list[ray.ObjectRef]:
        """Rollout `rollout_id`'s train data, read back into the object store."""
        assert self._kept is not None, "keep_train_data() first"
        shards = await asyncio.to_thread(self._kept.load, rollout_id)
        return [ray.put(shard) for shard in shards]

    async def drop_train_data(self, through: int) -> None:
        """A checkpoint covers the rollouts up to `through`: their train data goes."""
        if self._kept is not None:
            await asyncio.to_thread(self._kept.drop_through, through)

    async def engine_pids(self) -> list[int]:
        """Process ids of the engine servers (for monitoring, and tests that check shutdown)."""
        return await self.engines.engine_pids()

    def get_engine_urls(self) -> list[str]:
        return list(self.engines.engine_urls)

    def get_teacher_urls(self) -> list[str]:
        """The teacher engines' URLs (--use-opd); none without."""
        return list(self.engines.teachers.urls) if self.engines.teachers else []

    def get_startup_seconds(self) -> dict[str, float]:
        """How long `start_engines` and `load_data` took (each measured here, where it ran)."""
        return dict(self.startup_seconds)

    def _context(
        self,
        source: DataSource,
        rollout: RolloutConfig,
        data: DataSourceConfig,
        score_groups: ScoreGroups,
    ) -> RolloutContext:
        """What a rollout made from `source` with `rollout`'s settings reads."""
        return RolloutContext(
            pool=self.pool,
            data_source=source,
            score_groups=score_groups,
            rollout=rollout,
            data=data,
            tokenizer=self._loaded().tokenizer,
            chat_template=data.chat_template,
            model_path=self.config.checkpoint.hf_checkpoint,
            processor=(
                load_processor(self.config.checkpoint.hf_checkpoint)
                if self._reads_images()
                else None
            ),
        )

    def _train_context(self) -> RolloutContext:
        return self._context(self.data_source, self.config.rollout, self.config.data, self._score)

    # -- one rollout -------------------------------------------------------------------------

    async def generate(self, rollout_id: int) -> dict[str, Any]:
        """Generate and score rollout `rollout_id`; returns {"data": [ObjectRef per DP rank],
        "metrics": {...}}. Rank r trains on `data[r]`."""
        start = time.perf_counter()
        self._start_train_data_import()
        self._reset_reward_tallies()
        try:
            groups, metrics = await self._rollout(rollout_id)
        except EngineError as err:
            raise self.engines.explain(err) from err
        unscored = [g for g in groups if any(s.reward is None for s in g)]
        if unscored:  # a custom rollout function may leave scoring to the hub
            await self._score(unscored)
        result = await self._train_data(rollout_id, groups, metrics)
        result["metrics"]["rollout/time_s"] = time.perf_counter() - start
        return result

    async def _train_data(
        self, rollout_id: int, groups: list[list[Any]], metrics: dict[str, float]
    ) -> dict[str, Any]:
        """Scored groups as train data: {"data": [ObjectRef per DP rank], "metrics": {...}}.
        Every way of making a rollout (one rollout at a time, or taken from the fully-async
        buffer) ends here: a reward that failed too often stops it before it trains."""
        check_failure_rate(
            self._reward_failures, self._reward_scored, self._reward_failure_messages,
            max_rate=self.config.reward.max_reward_failure_rate, rollout_id=rollout_id,
        )  # fmt: skip
        train_data = await self._train_data_module()
        teachers = self.engines.teachers
        if teachers is not None:  # --use-opd: the teacher's log-prob of every response token
            metrics = {**metrics, **await teachers.score(groups)}
        shards = train_data.build_train_data(groups, self.config.algorithm, dp_size=self.dp_size)
        metrics = {**metrics, **train_data.rollout_metrics(groups), **self._reward_metrics}
        return {"data": [ray.put(shard) for shard in shards], "metrics": metrics}

    def _start_train_data_import(self) -> None:
        """Start importing `miles.rollout.train_data` (torch) in a thread, once.

        Nothing of this process needs torch before a rollout's end (the tokenizer loads without
        it), so the import runs while the rollout generates, when the engines work on other
        cores, instead of during start-up, when every process of the run imports at once."""
        if self._train_data_import is None:
            self._train_data_import = asyncio.ensure_future(asyncio.to_thread(_import_train_data))

    async def _train_data_module(self) -> ModuleType:
        self._start_train_data_import()
        assert self._train_data_import is not None
        return await self._train_data_import

    async def _rollout(self, rollout_id: int) -> tuple[list[list[Any]], dict[str, float]]:
        output = await self.rollout.generate_rollout(self._train_context(), rollout_id)
        return output.groups, dict(output.metrics)

    def _reset_reward_tallies(self) -> None:
        """Forget the reward tallies of the last rollout: each rollout counts its own."""
        self._reward_metrics: dict[str, float] = {}
        self._reward_failures = self._reward_scored = 0
        self._reward_failure_messages: list[str] = []
        self._reward_tallies: dict[str, RewardTally] = {}

    async def _score(self, groups: list[list[Any]]) -> Any:
        report = await self.reward_hub.score_groups(groups)
        self._reward_failures += report.failures
        self._reward_scored += len(report.rewards)
        room = MAX_FAILURE_MESSAGES - len(self._reward_failure_messages)
        self._reward_failure_messages += report.failure_messages[:room]
        if report.clipped is not None:
            clipped = self._reward_metrics.get("reward/clipped", 0.0) + report.clipped
            self._reward_metrics["reward/clipped"] = clipped
        self._reward_metrics["reward/failures"] = float(self._reward_failures)
        self._reward_metrics["reward/failure_rate"] = self._reward_failures / max(
            1, self._reward_scored
        )
        for name, tally in report.by_reward.items():
            self._reward_tallies.setdefault(name, RewardTally()).add(tally)
        if self._data is not None and self._data.names_rewards:  # rows or sources name theirs
            self._reward_metrics.update(reward_tally_metrics(self._reward_tallies))
        return report

    # -- evaluation --------------------------------------------------------------------------

    async def eval(self, rollout_id: int, names: list[str] | None = None) -> dict[str, float]:
        """Mean reward, pass@k and lengths on each held-out dataset (`names`, default: all),
        each prompt once, with the dataset's own sampling and reward (`EvalDatasetConfig`).

        Each held-out sample is made by the rollout's `for_evaluation()` rollout: the run's own
        (a tool rollout's multi-turn exchange with the tools), or for SFT the generating one."""
        self._start_train_data_import()
        metrics: dict[str, float] = {}
        rollout = self.rollout.for_evaluation()
        for eval_source in self.eval_sources:
            dataset = eval_source.config
            if names is not None and dataset.name not in names:
                continue
            # A fresh source per evaluation: every prompt once, in file order.
            source = RolloutDataSource(
                eval_source.prompts,
                dataset.data,
                n_samples_per_prompt=dataset.n_samples_per_eval_prompt,
            )
            settings = dataset.rollout_config(self.config.rollout, len(eval_source.prompts))
            score = self.eval_reward_hubs[dataset.name].score_groups
            ctx = self._context(source, settings, dataset.data, score)
            try:
                output = await run_groups(ctx, rollout.generate_group, rollout_id=rollout_id)
            except EngineError as err:
                raise self.engines.explain(err) from err
            train_data = await self._train_data_module()
            metrics.update(train_data.eval_metrics(output.groups, dataset.name, dataset.pass_at_k))
        return metrics

    # -- observability (miles.ray.observer) ---------------------------------------------------

    async def start_profiling(self, targets: list[str], out_dir: str, label: str) -> None:
        """Profile this process (py-spy) and/or the engines (their own profiler) until
        `stop_profiling`; `targets` are --profile-target's rollout-side names."""
        from miles.ray.rollout_profiling import RolloutProfiling

        assert self._profiling is None, "stop_profiling() before the next window"
        profiling = RolloutProfiling(targets, out_dir, label)
        await profiling.start(list(self.engines.engine_urls), self.engines.admin_key)
        self._profiling = profiling

    async def stop_profiling(self) -> list[str]:
        """End the window of `start_profiling`; the traces written."""
        profiling, self._profiling = self._profiling, None
        return [] if profiling is None else await profiling.stop(self.engines.admin_key)

    async def process_ids(self) -> dict[str, tuple[int, str]]:
        """{process label: (pid, Ray node id)} of this manager and each engine's server (whose
        child processes count with it), for the memory record."""
        node = ray.get_runtime_context().get_node_id()
        return {"rollout_manager": (os.getpid(), node), **await self.engines.engine_processes()}

    # -- memory, checkpoints, shutdown ---------------------------------------------------------

    async def offload(self) -> None:
        """Free the engines' device memory (weights and KV cache) for colocated training."""
        await self.pool.release_memory_occupation()

    async def onload(self, tags: list[str] | None = None) -> None:
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
        try:
            await self.engines.dispose()
        finally:
            hubs = {id(hub): hub for hub in (self.reward_hub, *self.eval_reward_hubs.values())}
            for hub in hubs.values():
                await hub.aclose()

    # -- fully-async generation (miles.rollout.fully_async) ---------------------------------

    async def start_fully_async(self, weight_version: int) -> None:
        """Start generating in the background with the engines at `weight_version`, from the
        buffer of the resumed checkpoint if there is one."""
        training, rollout = self.config.training, self.config.rollout
        assert training.fully_async_buffer_groups is not None, "derived by the config"
        config = FullyAsyncConfig(
            max_weight_staleness=training.max_weight_staleness,
            buffer_groups=training.fully_async_buffer_groups,
            unused_samples_handler=training.async_unused_samples_handler,
            partial_rollout=rollout.partial_rollout,
            mask_offpolicy=rollout.mask_offpolicy_in_partial_rollout,
        )
        run_group = group_runner(self._train_context(), self.rollout.generate_group)
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
            raise self.engines.explain(err) from err
        result = await self._train_data(rollout_id, groups, metrics)
        result["metrics"]["rollout/time_s"] = time.perf_counter() - start
        # Scoring runs all the time: each rollout reports what was scored since the last one.
        self._reset_reward_tallies()
        return result

    async def pause_for_weight_update(self) -> None:
        """Nothing in flight on return: the groups finished on the old weights, or (partial
        rollout) were aborted to continue on the new ones."""
        assert self._fully_async is not None, "start_fully_async() first"
        try:
            await self._fully_async.pause_for_update()
        except EngineError as err:
            raise self.engines.explain(err) from err

    async def resume_after_weight_update(self, weight_version: int) -> None:
        assert self._fully_async is not None, "start_fully_async() first"
        await self._fully_async.resume_after_update(weight_version)


def _import_train_data() -> ModuleType:
    """`miles.rollout.train_data`, imported late on purpose: it imports torch (seconds), which
    nothing of this process needs before a rollout's end (see the module docstring)."""
    from miles.rollout import train_data

    return train_data
