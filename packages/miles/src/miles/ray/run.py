"""`Run`: the processes of one training run and the steps the loop calls on them.

Entering a `Run` checks the directories it will read and write (`miles.utils.run_dirs`), connects
to Ray, reserves the placement group, starts the rollout manager (which starts the engines) and the
training group, and resumes from `--load`; leaving it stops everything, also after an error or
Ctrl-C (at once after `StopNow`). A stop signal (`GracefulStop`) makes the step in progress save
its checkpoint, and `stop_after` ends the loop after it. Each method is one step of the loop in `miles.train`, with its timing recorded, so the
loop itself reads as the algorithm.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import ray
from miles.backends.sglang_utils.server_process import ADMIN_KEY_ENV
from miles.backends.training_utils.algorithms.registry import loss_spec
from miles.config.miles_config import MilesConfig
from miles.ray.cluster import bind_host, init_ray
from miles.ray.cpu_threads import CpuThreads, cpu_threads_for_run
from miles.ray.critic_ranks import train_policy_and_critic
from miles.ray.placement import Placement, create_placement, plan_for_config, remove_placement
from miles.ray.rollout_manager import RolloutManager
from miles.ray.rollout_source import (
    EngineRollouts,
    PendingRollout,
    ReplayedRollouts,
    Rollout,
    RolloutSource,
    save_rollout,
)
from miles.ray.startup_clock import StartupClock
from miles.ray.train_group import RayTrainGroup, TrainRankError
from miles.ray.train_restarts import TrainRestarts
from miles.train_backend.run_spec import TrainRunSpec
from miles.utils.bytecode import uncached_bytecode_warning
from miles.utils.checkpoint_layout import iteration_dir, latest_rollout_id
from miles.utils.console import ConsoleView
from miles.utils.divergence import DivergenceGuard, vocab_size
from miles.utils.graceful_stop import GracefulStop
from miles.utils.plugins import TRAIN_BACKENDS, plugin_path
from miles.utils.run_dirs import checkpoint_to_resume, claim_output_dir
from miles.utils.run_lock import RunLock
from miles.utils.tracking import Tracker

logger = logging.getLogger(__name__)

T = TypeVar("T")


# While waiting for the rollout manager, ask it this often for restarted engines to restore.
_RESTORE_POLL_S = 1.0


class WeightSyncMismatchError(RuntimeError):
    """Trainer and engine disagree on log-probs after a weight update (the step-0 check)."""


class RolloutManagerTimeoutError(RuntimeError):
    """The rollout manager did not answer a call within its bound: its process is hung."""


class Run:
    def __init__(self, config: MilesConfig, *, stop: GracefulStop | None = None):
        """`stop`: the driver's signal state (`miles train`); None where nothing signals."""
        self.config = config
        self.stop = stop
        self._save_point_version: int | None = None  # the engines' version at the save point
        self._committed: int | None = None  # the last checkpoint this run completed
        self._has_gpus = False
        self._spec: TrainRunSpec | None = None  # what the train ranks were built with
        self._restarts: TrainRestarts | None = None  # --max-train-restarts, where it applies
        self.placement: Placement | None = None
        self._cpu_threads: CpuThreads | None = None  # torch threads per process, CPU-only runs
        self.rollout_manager: Any = None
        self.rollouts: RolloutSource | None = None
        self._startup_clock: StartupClock | None = None
        self.engine_urls: list[str] = []
        self._lock: RunLock | None = None  # --output-dir and --save, while the run lives
        self.trainers: RayTrainGroup | None = None
        self.critics: RayTrainGroup | None = None  # a critic on ranks of its own
        self.tracker: Tracker | None = None
        # --use-mlflow, --use-prometheus, --profile-target, --memory-snapshot-dir: None when
        # all are off, and then nothing of them is imported.
        self._sinks: Any = None  # ObservabilitySinks, until the tracker takes them
        self.observer: Any = None  # RunObserver
        self.console: ConsoleView | None = None
        self.start_rollout_id = 0
        self.num_rollout = 0
        self.fault_tolerant = False  # the rollout manager restarts lost engines
        self.weight_version: int | None = None  # the engines' version after the last push
        self._manager_place: Any = None  # the manager's `where()`, once asked
        self._uncommitted_save: int | None = None  # saved, named the latest once it is logged
        # The step-0 check compares with the engine's log-probs: a loss on given data (SFT) has
        # none to compare with, and a run without engines (replayed rollouts) nothing to check.
        self._weight_sync_to_check = (
            config.training.check_weight_sync_tolerance is not None
            and loss_spec(config.algorithm).on_policy
        )
        self.guard = DivergenceGuard(
            max_consecutive_nonfinite_steps=config.training.max_consecutive_nonfinite_steps,
            collapse_window=config.training.collapse_window,
            abort_on_collapse=config.training.abort_on_collapse,
            vocab_size=vocab_size(config.checkpoint.hf_checkpoint),
        )

    # -- set-up and tear-down ------------------------------------------------------------------

    def __enter__(self) -> Run:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        # Interrupted (a second signal, the stop's grace over, Ctrl-C outside `miles train`):
        # no call waits on a process, every one is killed.
        hurry = isinstance(exc_type, type) and issubclass(exc_type, KeyboardInterrupt)
        self.close(failed=exc_type is not None, hurry=hurry)

    def _start(self) -> None:
        """Start everything, overlapping what can overlap: the engine processes load their model
        while the rollout manager reads the prompts and the train ranks build theirs."""
        config, cluster, training = self.config, self.config.cluster, self.config.training
        # Before Ray starts anything: a directory another run holds, a wrong --load or a taken
        # --output-dir fails in a second.
        self._lock = RunLock(
            {"--output-dir": config.logging.output_dir, "--save": config.checkpoint.save}
        )
        resumed = checkpoint_to_resume(config.checkpoint.load, config.checkpoint.save)
        if config.critic.critic_load:  # verified too, and no newer than the policy it trains with
            checkpoint_to_resume(
                config.critic.critic_load, config.critic.critic_save, flag="--critic-load",
                at_most=resumed,
            )  # fmt: skip
        claim_output_dir(
            config.logging.output_dir,
            resuming=resumed is not None,
            overwrite=config.logging.overwrite_output_dir,
        )
        if warning := uncached_bytecode_warning():
            logger.warning(warning)
        clock = StartupClock()
        if config.observability.use_mlflow or config.observability.use_prometheus:
            from miles.utils.observability.sinks import ObservabilitySinks

            # MLflow opens its store meanwhile, in a thread (seconds of imports).
            self._sinks = ObservabilitySinks(
                config.observability, config.logging.output_dir,
                run_config=_jsonable(config.flat()), resuming=resumed is not None,
            )  # fmt: skip
        with clock.phase("ray"):
            self._has_gpus = self._join_ray()
        with clock.phase("placement"):
            self.placement = create_placement(
                plan_for_config(config, use_gpus=self._has_gpus),
                bind_host=bind_host(config.cluster.external_engine_urls),
            )
        self._cpu_threads = cpu_threads_for_run(
            self.placement.plan, self.placement.bundle_nodes, has_gpus=self._has_gpus,
            phases_overlap=training.async_train or training.fully_async,
        )  # fmt: skip
        dp_size = config.data_parallel_size  # the config checked it divides the ranks
        manager_class = ray.remote(RolloutManager).options(num_cpus=0, max_concurrency=16)
        # External engines' admin key comes from the driver's environment, as a reference
        # engine reads it, and never from the config, which the run records.
        manager = manager_class.remote(
            config, self.placement, dp_size=dp_size,
            external_admin_key=os.environ.get(ADMIN_KEY_ENV) or None,
            cpu_threads=self._cpu_threads,
        )  # fmt: skip
        self.rollout_manager = manager
        self._manager_place = manager.where.remote()  # read only to name a hung manager
        engines = None if training.debug_train_only else manager.start_engines.remote()
        dataset_size = manager.load_data.remote()
        train = not training.debug_rollout_only
        # Colocated engines take the shared devices when they start: they free them while the
        # trainer builds its model and optimizer, and get them back (the trainer asleep) before
        # the first weight update and generation.
        share_devices = cluster.colocate and engines is not None and train
        trainers_began = time.perf_counter()
        if train:
            # The rank processes start now, beside the engines.
            self.trainers = self._train_group()
            if config.critic.on_own_ranks:
                self.critics = self._train_group(critic=True)
        self.num_rollout = config.resolve_num_rollout(self._from_manager(dataset_size, "load_data"))
        if share_devices:
            self.engine_urls = self._from_manager(
                engines, "start_engines", engine_wait_s=self.config.engine.engine_startup_timeout_s
            )
            self._from_manager(
                manager.offload.remote(),
                "offload",
                engine_wait_s=self.config.engine.update_weights_timeout_s,
            )
        if self.trainers is not None:
            spec = TrainRunSpec.from_config(config, num_rollout=self.num_rollout)
            self._spec = spec
            assert config.backend is not None, "the schema adds the chosen backend's group"
            self.start_rollout_id = self.trainers.init(spec, config.algorithm, config.backend)
            clock.record({"trainers": time.perf_counter() - trainers_began})
            clock.record(self.trainers.startup_seconds())
            if self.trainers.dp_size != dp_size:
                raise RuntimeError(
                    f"the {cluster.train_backend} backend formed {self.trainers.dp_size} "
                    f"data-parallel replicas, but the rollout was split for {dp_size}"
                )
            if self.critics is not None:
                critics_began = time.perf_counter()
                self._init_critics(spec)
                clock.record({"critic_trainers": time.perf_counter() - critics_began})
        if engines is not None:
            if not self.engine_urls:  # colocated runs waited for them before the trainers built
                self.engine_urls = self._from_manager(
                    engines,
                    "start_engines",
                    engine_wait_s=self.config.engine.engine_startup_timeout_s,
                )
            self.fault_tolerant = self._from_manager(
                manager.uses_fault_tolerance.remote(), "uses_fault_tolerance"
            )
            self.rollouts = EngineRollouts(manager, await_call=self._await_manager)
            if self.trainers is not None:
                admin_key = self._from_manager(manager.engine_admin_key.remote(), "admin key")
                self.trainers.connect_engines(self.engine_urls, admin_key)
        else:
            assert training.load_debug_rollout_data, "checked by TrainingConfig"
            self.rollouts = ReplayedRollouts(training.load_debug_rollout_data, dp_size=dp_size)
        if share_devices:
            self.offload_trainer_and_onload_engines()
        clock.record(self._from_manager(manager.get_startup_seconds.remote(), "startup seconds"))
        self._resume_rollout_state()
        self._restarts = self._trainer_restarts()
        self.tracker = Tracker(
            config.logging.output_dir,
            use_tensorboard=config.logging.use_tensorboard,
            use_wandb=config.logging.use_wandb,
            wandb_project=config.logging.wandb_project,
            wandb_mode=config.logging.wandb_mode,
            wandb_run_name=config.logging.wandb_run_name,
            run_config=_jsonable(config.flat()),
            resume_from=self.start_rollout_id,
            sinks=self._sinks.ready(num_engines=len(self.engine_urls)) if self._sinks else (),
        )
        self._sinks = None
        if config.observability.profiles or config.observability.records_memory:
            from miles.ray.observer import RunObserver

            self.observer = RunObserver(
                config.observability, config.logging.output_dir, trainers=self.trainers,
                rollout_manager=self.rollout_manager, began_at=clock.began_at,
                critics=self.critics,
            )  # fmt: skip
        self.console = ConsoleView(self.num_rollout, config.logging.console)
        self._startup_clock = clock
        logger.info(
            "run: rollouts %d..%d of %d, %d train rank(s), %d engine(s)",
            self.start_rollout_id, self.num_rollout - 1, self.num_rollout, dp_size,
            len(self.engine_urls),
        )  # fmt: skip

    def _train_group(self, *, critic: bool = False) -> RayTrainGroup:
        """The policy's train ranks (or a critic's on ranks of its own), starting now."""
        cluster, placement, threads = self.config.cluster, self.placement, self._cpu_threads
        assert placement is not None
        return RayTrainGroup(
            plugin_path(TRAIN_BACKENDS, cluster.train_backend),
            placement,
            # Every rank of the plan: tensor/pipeline-parallel peers are ranks too (the
            # backend forms data_parallel_size replicas of them, checked after init).
            world_size=placement.plan.num_critic_ranks
            if critic
            else placement.plan.num_actor_ranks,
            colocate=cluster.colocate and not critic,
            has_gpus=self._has_gpus,
            cpus_per_bundle=cluster.cpus_per_bundle,
            call_timeout_s=self.config.training.train_call_timeout_s,
            critic=critic,
            cpu_threads=None if threads is None else threads.critic if critic else threads.train,
        )

    def _init_critics(self, spec: TrainRunSpec) -> None:
        """A critic on ranks of its own takes the policy's shards, and resumes where it does."""
        config, critics = self.config, self.critics
        assert critics is not None and self.trainers is not None and config.backend is not None
        start = critics.init(spec, config.algorithm, config.backend, role="critic")
        if critics.dp_size != self.trainers.dp_size:
            raise RuntimeError(
                f"the critic's ranks formed {critics.dp_size} data-parallel replicas and the "
                f"policy's {self.trainers.dp_size}; the critic takes the policy's shards (a bug: "
                "the configuration gives both as many ranks)"
            )
        if start != self.start_rollout_id:
            found = "no checkpoint" if start == 0 else f"rollout {start - 1}"
            raise ValueError(
                f"the policy resumes at rollout {self.start_rollout_id} from "
                f"{config.checkpoint.load}, but the critic's --critic-load "
                f"{config.critic.critic_load} holds {found}; point --critic-load at the critic "
                "saved with that policy checkpoint"
            )

    def _resume_rollout_state(self) -> None:
        """The rollout manager's data-source state from --load, checked against the trainer's."""
        resumed = self._from_manager(self.rollout_manager.load.remote(), "load")
        if self.trainers is not None and resumed is not None:
            if resumed + 1 != self.start_rollout_id:
                raise RuntimeError(
                    f"the trainer resumes at rollout {self.start_rollout_id} but the rollout state "
                    f"in {self.config.checkpoint.load} is of rollout {resumed}; use a --load "
                    "directory written by one run"
                )
        elif resumed is not None:
            self.start_rollout_id = resumed + 1

    def _join_ray(self) -> bool:
        """Join (or start) Ray; whether the cluster has GPUs."""
        # A local start gets this machine's devices, detected by Ray (asking torch would import
        # it, seconds, in a driver that never needs it). On CPU a bundle is a worker slot, not a
        # core, so a laptop with 2 cores still runs 3 slots: start enough for either plan.
        needed_cpus = 1 + max(
            int(plan_for_config(self.config, use_gpus=gpus).total_resources().get("CPU", 0))
            for gpus in (False, True)
        )
        init_ray(self.config.ray_address, num_cpus=max(os.cpu_count() or 1, needed_cpus))
        return ray.cluster_resources().get("GPU", 0) > 0

    # -- bounded waits on the rollout manager (docs/reliability.md) ------------------------------

    def _from_manager(self, call: Any, what: str, *, engine_wait_s: float = 0.0) -> Any:
        """The result of a rollout-manager call, within --rollout-manager-timeout-s plus
        `engine_wait_s`, the bound of the engine waits the call makes."""
        own_s = self.config.engine.rollout_manager_timeout_s
        try:
            return ray.get(call, timeout=own_s + engine_wait_s)
        except ray.exceptions.GetTimeoutError:
            bound = f"--rollout-manager-timeout-s {own_s:g} s"
            if engine_wait_s:
                bound += f" + {engine_wait_s:g} s for its engine waits"
            raise RolloutManagerTimeoutError(
                f"the rollout manager ({self._manager_where()}) did not answer {what} within "
                f"{bound}: it is hung; its log is in the Ray session's logs (worker-*.err)"
            ) from None

    def _manager_where(self) -> str:
        try:
            return ray.get(self._manager_place, timeout=1.0)
        except Exception:  # asked before it started, or it is the hung one: say what we know
            return "its process"

    def _await_manager(self, call: Any) -> Any:
        """The result of a long rollout-manager call (a rollout, an evaluation), bounded by the
        engine requests it makes. Every second the manager must show it is alive, within
        --rollout-manager-timeout-s; with fault tolerance, engines restarted meanwhile get the
        current weights (a rollout may need them to finish)."""
        while not ray.wait([call], timeout=_RESTORE_POLL_S)[0]:
            restarted = self._from_manager(
                self.rollout_manager.engines_awaiting_weights.remote(), "a liveness check"
            )
            if self.fault_tolerant:
                self._restore_engines(restarted)
        return ray.get(call)

    # -- engine recovery (architecture.md: "Fault tolerance") -----------------------------------

    def _restore_engines(self, urls: list[str], *, push_to: list[str] | None = None) -> None:
        """Push the current weights to `push_to` (default: `urls`), then admit the restarted
        engines `urls` back into service."""
        if not urls:
            return
        version = None
        if self.trainers is not None:
            targets = push_to or urls
            version = self._on_trainers(
                "restore_engines", lambda group: group.restore_engines(targets)
            )
            self.weight_version = version
        self._from_manager(
            self.rollout_manager.admit_engines.remote(urls, version), "admit_engines",
            engine_wait_s=self.config.engine.engine_control_timeout_s,
        )  # fmt: skip
        logger.info("engines %s restored at weight version %s", urls, version)

    # -- train-group restarts (architecture.md: "Trainer fault tolerance") -----------------------

    def _trainer_restarts(self) -> TrainRestarts | None:
        """--max-train-restarts, where a restarted group can return to the state it had."""
        limit, checkpoint = self.config.training.max_train_restarts, self.config.checkpoint
        if self.trainers is None or not limit:
            return None
        why_not = (
            "no --save: no checkpoint to return to" if not checkpoint.save
            # Every rollout since the start would be replayed, all their train data kept.
            else "no --save-interval: no checkpoint before the last" if not checkpoint.save_interval
            else "--colocate" if self.config.cluster.colocate
            else "a critic on ranks of its own" if self.critics is not None
            else None
        )  # fmt: skip
        if why_not:
            logger.info("train-group restarts are off (%s): a train rank's failure stops the run",
                        why_not)  # fmt: skip
            return None
        return TrainRestarts(limit, resume_at=self.start_rollout_id)

    def _on_trainers(
        self,
        what: str,
        call: Callable[[RayTrainGroup], T],
        *,
        engine_lost: Callable[[], bool] | None = None,
    ) -> T:
        """`call(self.trainers)`; when a train rank dies or hangs in it, the group starts again
        where it was (`_restart_trainers`) and the call goes again. `engine_lost`: whether an
        engine died under the call; a failure with every rank alive is then the engine's, and is
        raised for the engine's restart (the group stays: its ranks agreed on the failure)."""
        failed = False
        while True:
            try:
                if failed:  # a push that failed midway may have reached some engines in part
                    self._restart_trainers(pushing=what in ("update_weights", "restore_engines"))
                assert self.trainers is not None
                return call(self.trainers)
            except TrainRankError as err:
                if self._restarts is None:
                    raise
                if not err.rank_lost and engine_lost is not None and engine_lost():
                    raise
                self._restarts.count(err)  # past --max-train-restarts: raises, naming err
                failed = True

    def _restart_trainers(self, *, pushing: bool) -> None:
        """A new train group from the last checkpoint, trained again on the rollouts since (from
        their kept train data): it holds what the old one held. It takes up the engines' weight
        version, which is checked (`pushing`: the old group died pushing the next one)."""
        restarts, save = self._restarts, self.config.checkpoint.save
        assert restarts is not None and self.trainers is not None and self._spec is not None
        began = time.perf_counter()
        self._phase("restart trainers")
        self.trainers.shutdown(hurry=True)
        self.trainers = self._train_group()
        spec = self._spec
        if latest_rollout_id(save) is not None:  # else the checkpoint (if any) it started from
            spec = dataclasses.replace(spec, load=save)
        assert self.config.backend is not None
        start = self.trainers.init(spec, self.config.algorithm, self.config.backend)
        if start != restarts.resume_at:
            raise RuntimeError(
                f"the restarted train group resumed at rollout {start}, but this run's last "
                f"checkpoint is of rollout {restarts.resume_at - 1}; was --save {save} changed "
                "by another process?"
            )
        for rollout_id in restarts.trained:
            data = self._from_manager(
                self.rollout_manager.kept_train_data.remote(rollout_id), "kept_train_data"
            )
            self.trainers.train(rollout_id, data)
            restarts.replayed += 1
        self.trainers.rejoin(self.weight_version, restarts.restarts)
        if self.engine_urls:
            admin_key = self._from_manager(
                self.rollout_manager.engine_admin_key.remote(), "admin key"
            )
            self.trainers.connect_engines(self.engine_urls, admin_key)
            self._check_engine_versions(pushing=pushing)
        restarts.seconds_lost += time.perf_counter() - began
        logger.info("train group restarted in %.1f s; it replayed rollouts %s",
                    time.perf_counter() - began, restarts.trained or "none")  # fmt: skip

    def _check_engine_versions(self, *, pushing: bool) -> None:
        """The engines hold the weight version the run pushed last (or, when the old group died
        pushing, possibly part of the next one, which is then pushed again whole)."""
        if self.weight_version is None:
            return
        versions = self._from_manager(
            self.rollout_manager.engine_weight_versions.remote(), "engine_weight_versions",
            engine_wait_s=self.config.engine.engine_control_timeout_s,
        )  # fmt: skip
        allowed = {str(self.weight_version)} | (
            {str(self.weight_version + 1)} if pushing else set()
        )
        wrong = {url: found for url, found in versions.items() if found not in allowed}
        if wrong:
            raise RuntimeError(
                f"after the train group's restart, engines report weight versions {wrong}, but "
                f"the run pushed version {self.weight_version} last: they do not hold the "
                "weights the trainers returned to; run the same command to resume from the "
                "last checkpoint"
            )

    def close(self, *, failed: bool = False, hurry: bool = False) -> None:
        """Stop every process of the run; safe to call after a failed start. `failed`: the run
        ends with an error (MLflow marks its run so). `hurry`: kill the processes without
        asking them to close (the engine servers die with their actors)."""
        if self.console is not None:
            self.console.close()
        if self.observer is not None:  # its profilers and samplers live in the run's processes
            try:
                self.observer.close()
            except Exception as exc:
                logger.warning("closing the profilers and memory samplers: %s", exc)
            self.observer = None
        if self.trainers is not None:
            self.trainers.shutdown(hurry=hurry)
            self.trainers = None
        if self.critics is not None:
            self.critics.shutdown(hurry=hurry)
            self.critics = None
        if self.rollout_manager is not None:
            try:
                if not hurry:
                    ray.get(self.rollout_manager.dispose.remote(), timeout=120)
            except Exception as exc:
                logger.warning("disposing the rollout manager: %s", exc)
            ray.kill(self.rollout_manager)
            self.rollout_manager = None
        if self.placement is not None:
            remove_placement(self.placement)
            self.placement = None
        if self.tracker is not None:
            self.tracker.close(failed=failed)
            self.tracker = None
        if self._sinks is not None:
            self._sinks.abandon()
            self._sinks = None
        if self._lock is not None:  # last: the directories are the next run's from here
            self._lock.release()
            self._lock = None

    # -- the steps of the loop ------------------------------------------------------------------
    # Each step returns what it measured; the loop merges them into the rollout's record.

    def _phase(self, name: str, rollout_id: int | None = None) -> None:
        if self.stop is not None and rollout_id is not None:
            self.stop.running = True  # from the first step on, a stop signal waits for a save
            self.stop.rollout_id = rollout_id
        if self.console is not None:
            self.console.update(name, rollout_id)
        if self.observer is not None:
            self.observer.phase(name, rollout_id)

    def initial_weight_update(self) -> dict[str, float]:
        """Engines start from --hf-checkpoint; a resumed trainer holds newer weights, and the
        first update also sets every engine's weight version to the trainer's. It ends the
        start-up: returns the start-up's metrics (`StartupClock`) for the first rollout's record."""
        assert self._startup_clock is not None, "entered Run"
        if self.trainers is not None and self.engine_urls:
            self._phase("initial weight update")
            with self._startup_clock.phase("first_weight_update"):
                self.update_weights()
        return self._startup_clock.finish()

    def generate(self, rollout_id: int) -> Rollout:
        return self.wait_generate(self.start_generate(rollout_id))

    def start_generate(self, rollout_id: int) -> PendingRollout:
        self._phase("generate", rollout_id)
        assert self.rollouts is not None, "entered Run"
        return self.rollouts.start(rollout_id)

    def wait_generate(self, pending: PendingRollout) -> Rollout:
        """The train data of a started generation (one ObjectRef per data-parallel replica)."""
        assert self.rollouts is not None, "entered Run"
        rollout = self.rollouts.wait(pending)
        if self.config.training.save_debug_rollout_data:
            save_rollout(self.config.training.save_debug_rollout_data, rollout)
        return rollout

    def wait_generated(self, pending: PendingRollout) -> None:
        """Block until a started generation is done (async mode's barrier before an update)."""
        assert self.rollouts is not None, "entered Run"
        self.rollouts.wait_done(pending)

    def check_weight_sync(self, rollout: Rollout) -> dict[str, float]:
        """Step-0 check (architecture.md: "The loop"): after the first update, the trainer's
        log-probs of the first rollout must match the engine's."""
        if not self._weight_sync_to_check or self.trainers is None or not self.engine_urls:
            return {}
        self._weight_sync_to_check = False
        tolerance = self.config.training.check_weight_sync_tolerance
        assert tolerance is not None
        gap = self.trainers.logprob_gap(rollout.data)
        logger.info("step-0 check: mean |trainer - engine| log-prob = %.3g", gap)
        if gap > tolerance:
            raise WeightSyncMismatchError(
                f"after the weight update of rollout {rollout.rollout_id}, trainer and engine "
                f"log-probs differ by {gap:.4g} per token on average (tolerance "
                f"--check-weight-sync-tolerance {tolerance}): the engine is not running the "
                "trained weights (check the weight-sync path, dtype and --rollout-temperature)"
            )
        return {"check/logprob_abs_diff": gap}

    def train(self, rollout: Rollout) -> dict[str, float]:
        """This rollout's optimizer steps; the last step's metrics and the time taken."""
        if self.trainers is None:
            return {}
        self._phase("train", rollout.rollout_id)
        start = time.perf_counter()
        if self.critics is not None:
            steps = train_policy_and_critic(
                self.trainers, self.critics, rollout.rollout_id, rollout.data
            )
        else:
            steps = self._train_kept(rollout)
        skipped = self.guard.record_steps(rollout.rollout_id, steps)
        metrics = {
            (k if "/" in k else f"train/{k}"): v
            for k, v in (steps[-1] if steps else {}).items()
            if isinstance(v, int | float)
        }
        return {**metrics, "train/skipped_steps": float(skipped),
                "time/train_s": time.perf_counter() - start}  # fmt: skip

    def _train_kept(self, rollout: Rollout) -> list[dict[str, Any]]:
        """Train on `rollout`, its train data written to disk meanwhile when a restarted train
        group may have to replay it."""
        rollout_id = rollout.rollout_id
        if self._restarts is None:
            assert self.trainers is not None
            return self.trainers.train(rollout_id, rollout.data)
        keep = self.rollout_manager.keep_train_data.remote(rollout_id, list(rollout.data))
        steps = self._on_trainers(
            f"train (rollout {rollout_id})", lambda group: group.train(rollout_id, rollout.data)
        )
        self._from_manager(keep, "keep_train_data")
        self._restarts.trained_rollout(rollout_id)
        return steps

    def maybe_save(self, rollout_id: int) -> dict[str, float]:
        """Save every --save-interval rollouts, after the last, and when a stop was asked for."""
        checkpoint = self.config.checkpoint
        self._save_point_version = self.weight_version
        last = rollout_id + 1 == self.num_rollout
        if not checkpoint.save or self.trainers is None:
            return {}
        stopping = self.stop is not None and self.stop.requested
        if not last and not stopping and not (checkpoint.save_interval and (rollout_id + 1) % checkpoint.save_interval == 0):  # fmt: skip
            return {}
        self._phase("save", rollout_id)
        start = time.perf_counter()
        self._save(rollout_id)
        return {"time/save_s": time.perf_counter() - start}

    def _save(self, rollout_id: int, weight_version: int | None = None) -> None:
        # The rollout state, then the trainer's part; `finish_rollout` writes the pointer that
        # completes them after the rollout's record is logged.
        assert self.trainers is not None
        self._from_manager(self.rollout_manager.save.remote(rollout_id), "save")
        self._on_trainers(
            "save_model", lambda group: group.save_model(rollout_id, False, weight_version)
        )
        if self.critics is not None:
            self.critics.save_model(rollout_id, False)
        self._uncommitted_save = rollout_id

    def _commit(self, rollout_id: int) -> None:
        assert self._uncommitted_save == rollout_id and self.trainers is not None
        self._on_trainers("commit_checkpoint", lambda group: group.commit_checkpoint(rollout_id))
        if self.critics is not None:
            self.critics.commit_checkpoint(rollout_id)
        self._uncommitted_save = None
        self._committed = rollout_id
        if self._restarts is not None:  # a restart returns here: the older train data goes
            self._restarts.checkpointed(rollout_id)
            self._from_manager(self.rollout_manager.drop_train_data.remote(rollout_id), "drop")

    def stop_after(self, rollout_id: int) -> bool:
        """Whether the loop ends after this rollout because a stop signal came. Its checkpoint
        is then complete: saved at the step's save point, or now when the signal came after
        it (recording the weight version of the save point, as that save would have)."""
        if self.stop is None or not self.stop.requested:
            return False
        save = self.config.checkpoint.save
        if save and self.trainers is not None and self._committed != rollout_id:
            self._phase("save", rollout_id)
            self._save(rollout_id, self._save_point_version)
            self._commit(rollout_id)
        self.stop.rollout_id = rollout_id
        if self._committed == rollout_id:
            self.stop.checkpoint = iteration_dir(save, rollout_id).name
        return True

    def offload_engines(self) -> None:
        self._phase("offload engines")
        self._from_manager(
            self.rollout_manager.offload.remote(),
            "offload",
            engine_wait_s=self.config.engine.update_weights_timeout_s,
        )
        if self.trainers is not None:
            self.trainers.wake_up()

    def offload_trainer_and_onload_engines(self) -> None:
        if self.trainers is not None:
            self.trainers.sleep()
        self._from_manager(
            self.rollout_manager.onload.remote(),
            "onload",
            engine_wait_s=self.config.engine.update_weights_timeout_s,
        )

    def update_weights(self) -> dict[str, float]:
        if self.trainers is None or not self.engine_urls:
            return {}
        self._phase("update weights")
        start = time.perf_counter()
        if not self.fault_tolerant:
            self.weight_version = self._push_weights()
            return {"time/update_weights_s": time.perf_counter() - start}
        # Engines lost since the last rollout are back (or the run stops) before the push;
        # external engines lost for good are left out of it.
        self._restore_engines(self._recover_engines())
        self._drop_lost_engines()
        try:
            self.weight_version = self._push_weights()
        except Exception as err:
            lost = self._recover_engines()
            dropped = self._drop_lost_engines()
            if not lost and not dropped:
                raise  # every engine answers: not an engine's failure
            # The failed push may have reached some engines in part: every engine gets the
            # new version again, whole, and the restarted ones return to service.
            logger.warning("weight update failed with engines %s lost (%s); pushing again",
                           lost or dropped, err)  # fmt: skip
            if lost:
                self._restore_engines(lost, push_to=list(self.engine_urls))
            else:
                urls = list(self.engine_urls)
                self.weight_version = self._on_trainers(
                    "restore_engines", lambda group: group.restore_engines(urls)
                )
        return {"time/update_weights_s": time.perf_counter() - start}

    def _push_weights(self) -> int:
        return self._on_trainers(
            "update_weights", lambda group: group.update_weights(),
            engine_lost=self._any_engine_lost if self.fault_tolerant else None,
        )  # fmt: skip

    def _any_engine_lost(self) -> bool:
        """Whether an engine was lost (restarted meanwhile, or an external one gone for good)."""
        if self._recover_engines():
            return True
        lost = self._from_manager(
            self.rollout_manager.engines_lost_for_good.remote(), "engines_lost_for_good"
        )
        return any(url in lost for url in self.engine_urls)

    def update_due(self, rollout_id: int) -> bool:
        """Whether the weights go to the engines after rollout `rollout_id`: every
        --update-weights-interval rollouts, and after the last (evaluation reads them)."""
        done = rollout_id + 1
        return done % self.config.training.update_weights_interval == 0 or done == self.num_rollout

    # -- fully-async (miles.rollout.fully_async) -------------------------------------------------

    def start_fully_async(self) -> None:
        """Start the background generation, with the engines at the version just pushed."""
        assert self.weight_version is not None, "initial_weight_update() first"
        self._from_manager(
            self.rollout_manager.start_fully_async.remote(self.weight_version), "start_fully_async"
        )

    def take_rollout(self, rollout_id: int) -> Rollout:
        """The next train batch from the fully-async buffer (waiting until it is ready)."""
        self._phase("wait for rollout", rollout_id)
        assert isinstance(self.rollouts, EngineRollouts), "fully-async generates on engines"
        rollout = self.rollouts.take(rollout_id)
        if self.config.training.save_debug_rollout_data:
            save_rollout(self.config.training.save_debug_rollout_data, rollout)
        return rollout

    def update_weights_while_generating(self) -> dict[str, float]:
        """A fully-async weight update: generation stops (what is in flight finishes on the old
        weights, or is aborted to continue on the new ones), the weights go out, generation
        goes on at the new version."""
        start = time.perf_counter()
        self._phase("pause generation")
        self._await_manager(self.rollout_manager.pause_for_weight_update.remote())
        paused = time.perf_counter()
        updated = self.update_weights()
        self._from_manager(
            self.rollout_manager.resume_after_weight_update.remote(self.weight_version),
            "resume_after_weight_update", engine_wait_s=self.config.engine.engine_control_timeout_s,
        )  # fmt: skip
        return {**updated, "async/update_pause_s": paused - start,
                "time/update_weights_s": time.perf_counter() - start}  # fmt: skip

    def _drop_lost_engines(self) -> list[str]:
        """External engines lost for good leave the trainers' weight pushes (a push to a dead
        engine fails); the engines dropped now."""
        lost = self._from_manager(
            self.rollout_manager.engines_lost_for_good.remote(), "engines_lost_for_good"
        )
        dropped = [url for url in self.engine_urls if url in lost]
        if dropped and self.trainers is not None:
            self.engine_urls = [url for url in self.engine_urls if url not in lost]
            admin_key = self._from_manager(
                self.rollout_manager.engine_admin_key.remote(), "admin key"
            )
            self.trainers.connect_engines(self.engine_urls, admin_key)
            logger.warning("external engines %s are lost: the weights go to the %d left, %s",
                           dropped, len(self.engine_urls), self.engine_urls)  # fmt: skip
        return dropped

    def _recover_engines(self) -> list[str]:
        call = self.rollout_manager.recover_engines.remote()
        return self._from_manager(
            call, "recover_engines", engine_wait_s=self.config.engine.engine_startup_timeout_s
        )

    def evaluate_before_training(self) -> None:
        """Evaluate the starting weights and log them as rollout -1 (not on resume: the run
        already evaluated these weights after rollout start - 1)."""
        if self.start_rollout_id > 0 or not self._can_evaluate():
            return
        metrics = self._evaluate(self.start_rollout_id)
        assert self.tracker is not None
        self.tracker.log(metrics, step=self.start_rollout_id - 1)
        if self.console is not None:
            self.console.record(0, metrics)

    def maybe_eval(self, rollout_id: int) -> dict[str, float]:
        """Evaluate each dataset due after this rollout: every --eval-interval rollouts (or the
        dataset's own interval, from --eval-config) and after the last."""
        due = [
            d.name
            for d in self.config.eval.eval_datasets
            if d.due_after(rollout_id, self.num_rollout)
        ]
        return self._evaluate(rollout_id, due) if due and self._can_evaluate() else {}

    def _can_evaluate(self) -> bool:
        return bool(self.config.eval.eval_datasets) and bool(self.engine_urls)

    def _evaluate(self, rollout_id: int, names: list[str] | None = None) -> dict[str, float]:
        """Evaluate the datasets `names` (default: all); `eval/reward_mean` averages the mean
        rewards of the datasets evaluated."""
        self._phase("eval", rollout_id)
        start = time.perf_counter()
        metrics = self._await_manager(self.rollout_manager.eval.remote(rollout_id, names))
        metrics["time/eval_s"] = time.perf_counter() - start
        rewards = [v for k, v in metrics.items() if k.endswith("/reward_mean")]
        if rewards:
            metrics["eval/reward_mean"] = sum(rewards) / len(rewards)
        return metrics

    def finish_rollout(self, rollout_id: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Log everything measured for this rollout, name its checkpoint (if saved) the latest,
        then stop the run if it diverged (a DivergenceError); returns the metrics.

        The pointer comes after the record: a run killed in between resumes from the previous
        checkpoint and logs this rollout again, where the other order would lose its record."""
        assert self.tracker is not None
        if self.fault_tolerant:  # counted now: a restart during this rollout's update counts too
            fault_metrics = self._from_manager(
                self.rollout_manager.fault_metrics.remote(), "fault_metrics"
            )
            metrics = {**metrics, **fault_metrics}
        if self._restarts is not None:
            metrics = {**metrics, **self._restarts.metrics()}
        if self.observer is not None:  # the memory record; a profiling window may end here
            metrics = {**metrics, **self.observer.finish_rollout(rollout_id)}
        self.tracker.log(metrics, step=rollout_id)
        if self._uncommitted_save is not None:
            self._commit(rollout_id)
        if self.console is not None:
            self.console.record(rollout_id, metrics)
        self.guard.check(rollout_id, metrics)
        return metrics


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v if isinstance(v, str | int | float | bool | list | type(None)) else str(v)
        for k, v in values.items()
    }
