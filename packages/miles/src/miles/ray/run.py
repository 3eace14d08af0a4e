"""`Run`: the processes of one training run and the steps the loop calls on them.

Entering a `Run` connects to Ray, reserves the placement group, starts the rollout manager (which
starts the engines) and the training group, and resumes from `--load`; leaving it stops everything,
also after an error or Ctrl-C. Each method is one step of the loop in `miles.train`, with its timing
recorded, so the loop itself reads as the algorithm.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

import ray
from miles.config.schema import MilesConfig
from miles.ray.cluster import init_ray
from miles.ray.placement import Placement, create_placement, plan_for_cluster, remove_placement
from miles.ray.rollout_manager import RolloutManager
from miles.ray.train_group import RayTrainGroup
from miles.utils.console import ConsoleView
from miles.utils.plugins import TRAIN_BACKENDS, load_plugin
from miles.utils.tracking import Tracker

logger = logging.getLogger(__name__)


class WeightSyncMismatchError(RuntimeError):
    """Trainer and engine disagree on log-probs after a weight update (the step-0 check)."""


class Run:
    def __init__(self, config: MilesConfig):
        self.config = config
        self.timings: dict[str, float] = {}
        self.placement: Placement | None = None
        self.rollout_manager: Any = None
        self.trainers: RayTrainGroup | None = None
        self.tracker: Tracker | None = None
        self.console: ConsoleView | None = None
        self.start_rollout_id = 0
        self.num_rollout = 0
        self._weight_sync_checked = False

    # -- set-up and tear-down ------------------------------------------------------------------

    def __enter__(self) -> Run:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _start(self) -> None:
        config, cluster, training = self.config, self.config.cluster, self.config.training
        self.placement, has_gpus = self._reserve_placement()
        dp_size = config.data_parallel_size  # the config checked it divides the ranks
        manager_class = ray.remote(RolloutManager).options(num_cpus=0, max_concurrency=16)
        self.rollout_manager = manager_class.remote(config, self.placement, dp_size=dp_size)
        dataset_size = ray.get(self.rollout_manager.get_dataset_size.remote())
        self.num_rollout = config.resolve_num_rollout(dataset_size)
        if not training.debug_train_only:
            engine_urls = ray.get(self.rollout_manager.start_engines.remote())
        else:
            engine_urls = []
        # Colocated engines took the shared devices when they started: they free them while the
        # trainer builds its model and optimizer, and get them back (the trainer asleep) before
        # the first weight update and generation.
        share_devices = cluster.colocate and bool(engine_urls) and not training.debug_rollout_only
        if share_devices:
            ray.get(self.rollout_manager.offload.remote())
        if not training.debug_rollout_only:
            self.trainers = RayTrainGroup(
                load_plugin(TRAIN_BACKENDS, cluster.train_backend),
                self.placement,
                world_size=dp_size,
                colocate=cluster.colocate,
                has_gpus=has_gpus,
                cpus_per_bundle=cluster.cpus_per_bundle,
            )
            args = config.actor_args()
            args.engine_urls = engine_urls
            args.num_rollout = self.num_rollout
            self.start_rollout_id = self.trainers.init(args, "actor", with_ref=False)
            if self.trainers.dp_size != dp_size:
                raise RuntimeError(
                    f"the {cluster.train_backend} backend formed {self.trainers.dp_size} "
                    f"data-parallel replicas, but the rollout was split for {dp_size}"
                )
        if share_devices:
            self.offload_trainer_and_onload_engines()
        resumed = ray.get(self.rollout_manager.load.remote())
        if self.trainers is not None and resumed is not None:
            if resumed + 1 != self.start_rollout_id:
                raise RuntimeError(
                    f"the trainer resumes at rollout {self.start_rollout_id} but the rollout state "
                    f"in {config.checkpoint.load} is of rollout {resumed}; use a --load directory "
                    "written by one run"
                )
        elif resumed is not None:
            self.start_rollout_id = resumed + 1
        self.tracker = Tracker(
            config.logging.output_dir,
            use_tensorboard=config.logging.use_tensorboard,
            use_wandb=config.logging.use_wandb,
            wandb_project=config.logging.wandb_project,
            wandb_mode=config.logging.wandb_mode,
            wandb_run_name=config.logging.wandb_run_name,
            run_config=_jsonable(config.flat()),
            resume_from=self.start_rollout_id,
        )
        self.console = ConsoleView(self.num_rollout, config.logging.console)
        logger.info(
            "run: rollouts %d..%d of %d, %d train rank(s), %d engine(s)",
            self.start_rollout_id, self.num_rollout - 1, self.num_rollout, dp_size, len(engine_urls),
        )  # fmt: skip

    def _reserve_placement(self) -> tuple[Placement, bool]:
        """Join (or start) Ray and reserve the run's bundles; also whether the cluster has GPUs."""
        # A local start gets this machine's devices; on CPU a bundle is a worker slot, not a
        # core, so a laptop with 2 cores still runs 3 slots.
        plan = plan_for_cluster(self.config.cluster, use_gpus=torch.cuda.is_available())
        needed_cpus = int(plan.total_resources().get("CPU", 0) + 1)
        init_ray(self.config.ray_address, num_cpus=max(os.cpu_count() or 1, needed_cpus))
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        if has_gpus != ("GPU" in plan.total_resources()):
            # A joined cluster's devices are not this driver's (e.g. a CPU-only head node).
            plan = plan_for_cluster(self.config.cluster, use_gpus=has_gpus)
        return create_placement(plan), has_gpus

    def close(self) -> None:
        """Stop every process of the run; safe to call after a failed start."""
        if self.console is not None:
            self.console.close()
        if self.trainers is not None:
            self.trainers.shutdown()
            self.trainers = None
        if self.rollout_manager is not None:
            try:
                ray.get(self.rollout_manager.dispose.remote(), timeout=120)
            except Exception as exc:
                logger.warning("disposing the rollout manager: %s", exc)
            ray.kill(self.rollout_manager)
            self.rollout_manager = None
        if self.placement is not None:
            remove_placement(self.placement)
            self.placement = None
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None

    # -- the steps of the loop ------------------------------------------------------------------

    def _phase(self, name: str, rollout_id: int | None = None) -> None:
        if self.console is not None:
            self.console.update(name, rollout_id)

    def _timed(self, key: str, start: float) -> None:
        self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - start

    def initial_weight_update(self) -> None:
        """Engines start from --hf-checkpoint; a resumed trainer holds newer weights, and the
        first update also sets every engine's weight version to the trainer's."""
        if self.trainers is not None and not self.config.training.debug_train_only:
            self._phase("initial weight update")
            self.update_weights()

    def generate(self, rollout_id: int) -> list[ray.ObjectRef]:
        return self.wait_generate(self.start_generate(rollout_id))

    def start_generate(self, rollout_id: int) -> tuple[int, Any, float]:
        self._phase("generate", rollout_id)
        if self.config.training.debug_train_only:
            return rollout_id, None, time.perf_counter()
        return rollout_id, self.rollout_manager.generate.remote(rollout_id), time.perf_counter()

    def wait_generate(self, pending: Any, *, ready: bool = False) -> Any:
        """The train data of a started generation (as ObjectRefs, one per DP rank).

        With `ready=True` only waits for it and returns it unchanged (async mode's barrier
        before a weight update)."""
        rollout_id, call, start = pending
        if ready:
            ray.wait([call]) if call is not None else None
            return pending
        if call is None:
            data = self._load_debug_rollout(rollout_id)
            self.rollout_metrics = {}
        else:
            result = ray.get(call)
            data, self.rollout_metrics = result["data"], result["metrics"]
        self._timed("time/generate_s", start)
        if self.config.training.save_debug_rollout_data:
            self._save_debug_rollout(rollout_id, data)
        return data

    def _save_debug_rollout(self, rollout_id: int, data: list[ray.ObjectRef]) -> None:
        path = Path(self.config.training.save_debug_rollout_data.format(rollout_id=rollout_id))
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"rollout_id": rollout_id, "shards": ray.get(list(data))}, path)

    def _load_debug_rollout(self, rollout_id: int) -> list[ray.ObjectRef]:
        pattern = self.config.training.load_debug_rollout_data
        path = Path(pattern.format(rollout_id=rollout_id))
        if not path.is_file():
            raise FileNotFoundError(
                f"--debug-train-only: no saved rollout {rollout_id} at {path} (from "
                f"--load-debug-rollout-data {pattern}); save rollouts first with "
                "--save-debug-rollout-data"
            )
        shards = torch.load(path, weights_only=False)["shards"]
        dp_size = self.config.cluster.actor_world_size
        if len(shards) != dp_size:
            raise ValueError(
                f"{path} holds {len(shards)} data-parallel shards but this run trains on "
                f"{dp_size} ranks; replay with the same --actor-num-nodes x "
                "--actor-num-gpus-per-node as the run that saved it"
            )
        return [ray.put(shard) for shard in shards]

    def check_weight_sync(self, rollout_id: int, data: list[ray.ObjectRef]) -> None:
        """Step-0 check (DESIGN §3.4): after the first update, the trainer's log-probs of the
        first rollout must match the engine's."""
        tolerance = self.config.training.check_weight_sync_tolerance
        if self._weight_sync_checked or self.trainers is None or tolerance is None:
            return
        if self.config.training.debug_train_only or self.config.algorithm.loss_type == "sft_loss":
            return  # replayed or supervised data: no engine log-probs to compare with
        self._weight_sync_checked = True
        gap = self.trainers.logprob_gap(data)
        self.rollout_metrics["check/logprob_abs_diff"] = gap
        logger.info("step-0 check: mean |trainer - engine| log-prob = %.3g", gap)
        if gap > tolerance:
            raise WeightSyncMismatchError(
                f"after the weight update of rollout {rollout_id}, trainer and engine log-probs "
                f"differ by {gap:.4g} per token on average (tolerance "
                f"--check-weight-sync-tolerance {tolerance}): the engine is not running the "
                "trained weights (check the weight-sync path, dtype and --rollout-temperature)"
            )

    def train(self, rollout_id: int, data: list[ray.ObjectRef]) -> None:
        self.train_metrics: dict[str, float] = {}
        if self.trainers is None:
            return
        self._phase("train", rollout_id)
        start = time.perf_counter()
        steps = self.trainers.train(rollout_id, data)
        self._timed("time/train_s", start)
        if steps:
            last = steps[-1]
            self.train_metrics = {
                (k if "/" in k else f"train/{k}"): v
                for k, v in last.items()
                if isinstance(v, int | float)
            }

    def maybe_save(self, rollout_id: int) -> None:
        checkpoint = self.config.checkpoint
        last = rollout_id + 1 == self.num_rollout
        if not checkpoint.save or self.trainers is None:
            return
        if not last and not (checkpoint.save_interval and (rollout_id + 1) % checkpoint.save_interval == 0):  # fmt: skip
            return
        self._phase("save", rollout_id)
        start = time.perf_counter()
        # The rollout state first: the trainer's save writes the pointer that completes it.
        ray.get(self.rollout_manager.save.remote(rollout_id))
        self.trainers.save_model(rollout_id)
        self._timed("time/save_s", start)

    def offload_engines(self) -> None:
        self._phase("offload engines")
        ray.get(self.rollout_manager.offload.remote())
        if self.trainers is not None:
            self.trainers.wake_up()

    def offload_trainer_and_onload_engines(self) -> None:
        if self.trainers is not None:
            self.trainers.sleep()
        ray.get(self.rollout_manager.onload.remote())

    def update_weights(self) -> None:
        if self.trainers is None or self.config.training.debug_train_only:
            return
        self._phase("update weights")
        start = time.perf_counter()
        self.trainers.update_weights()
        self._timed("time/update_weights_s", start)

    def maybe_eval(self, rollout_id: int, *, before_training: bool = False) -> None:
        """Evaluate before the first rollout, every --eval-interval rollouts and after the last."""
        self.eval_metrics: dict[str, float] = {}
        eval_ = self.config.eval
        if not eval_.eval_datasets or self.config.training.debug_train_only:
            return
        if before_training and self.start_rollout_id > 0:
            return  # resumed: the run already evaluated these weights after rollout start - 1
        done = rollout_id + 1
        due = before_training or done == self.num_rollout
        due = due or bool(eval_.eval_interval and done % eval_.eval_interval == 0)
        if not due:
            return
        self._phase("eval", rollout_id)
        metrics = ray.get(self.rollout_manager.eval.remote(rollout_id))
        rewards = [v for k, v in metrics.items() if k.endswith("/reward_mean")]
        if rewards:
            metrics["eval/reward_mean"] = sum(rewards) / len(rewards)
        step = rollout_id - 1 if before_training else rollout_id
        if before_training:
            assert self.tracker is not None
            self.tracker.log(metrics, step=step)
            if self.console is not None:
                self.console.record(max(step, 0), metrics)
        else:
            self.eval_metrics = metrics

    def finish_rollout(self, rollout_id: int, step_s: float) -> dict[str, Any]:
        """Log everything measured for this rollout; returns it."""
        metrics = {
            **getattr(self, "rollout_metrics", {}),
            **getattr(self, "train_metrics", {}),
            **getattr(self, "eval_metrics", {}),
            **self.timings,
            "time/step_s": step_s,
        }
        self.timings = {}
        assert self.tracker is not None
        self.tracker.log(metrics, step=rollout_id)
        if self.console is not None:
            self.console.record(rollout_id, metrics)
        return metrics


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v if isinstance(v, str | int | float | bool | list | type(None)) else str(v)
        for k, v in values.items()
    }
