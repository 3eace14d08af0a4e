"""The teacher engines of on-policy distillation (--use-opd), owned by the rollout manager.

Each teacher is a `RolloutEngineActor` in its own placement bundles (`PlacementPlan.
teacher_bundles`), launched through the same launch spec as the student's engines with the
teacher's checkpoint. Teachers never get weight updates, never sleep and are not supervised:
they only score (`miles.rollout.opd`) through their own `EnginePool`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
from miles.config.miles_config import MilesConfig
from miles.ray.engine_actor import RolloutEngineActor
from miles.ray.placement import Placement
from miles.rollout.engine_pool import EnginePool
from miles.rollout.opd import score_with_teacher, teacher_kl_metrics
from miles.utils.failures import describe

logger = logging.getLogger(__name__)


class TeacherEngines:
    """Start, use and stop the teacher engines of one run."""

    def __init__(self, config: MilesConfig, placement: Placement | None, *, admin_key: str):
        assert config.distillation.use_opd, "teacher engines exist only with --use-opd"
        self.config, self.placement, self.admin_key = config, placement, admin_key
        self.actors: list[Any] = []
        self.urls: list[str] = []
        self.pool: EnginePool | None = None

    async def start(
        self,
        engine: str,
        spec: dict[str, Any],
        *,
        has_gpus: bool,
        cpu_threads: Sequence[int] | None = None,
    ) -> list[str]:
        """Launch every teacher (`engine` as the student's, `spec` the student's engine 0 launch
        spec, adapted) and wait until all answer; `cpu_threads`: each teacher's torch threads
        (`CpuThreads.teachers`; None: inherited)."""
        distillation, backend = self.config.distillation, self.config.backend
        assert backend is not None, "the schema adds the chosen backend's group (--seed)"
        num = len(self.placement.plan.teacher_bundles) if self.placement else 1
        log_dir = Path(spec["log_path"]).parent
        starts = []
        for i in range(num):
            teacher_spec = {
                **spec,
                "model_path": distillation.opd_teacher_checkpoint,
                "num_devices": distillation.opd_teacher_num_gpus_per_engine,
                "random_seed": backend.seed + 1000 + i,
                "log_path": str(log_dir / f"teacher_{i}.log"),
                "visible_devices": self.placement.teacher_devices(i) if self.placement else None,
                "admin_api_key": self.admin_key,
                "return_routed_experts": False,  # the teacher only scores; nothing replays it
                "cpu_threads": None if cpu_threads is None else cpu_threads[i],
            }
            actor = self._actor(i, has_gpus)
            self.actors.append(actor)
            starts.append(actor.start.remote(engine, teacher_spec))
        logger.info("starting %d %s teacher engine(s) of %s", num, engine,
                    distillation.opd_teacher_checkpoint)  # fmt: skip
        bound = self.config.engine.engine_startup_timeout_s + 60.0
        self.urls = list(await asyncio.wait_for(asyncio.gather(*starts), bound))
        engine_config = self.config.engine
        self.pool = EnginePool(
            self.urls,
            timeout_s=engine_config.rollout_request_timeout_s,
            per_token_s=engine_config.rollout_request_timeout_per_token_s,
            control_timeout_s=engine_config.engine_control_timeout_s,
            api_key=self.admin_key,
        )
        return list(self.urls)

    def _actor(self, index: int, has_gpus: bool) -> Any:
        options: dict[str, Any] = {
            "num_cpus": self.config.cluster.cpus_per_bundle,
            "num_gpus": 1 if has_gpus else 0,
        }
        if self.placement is not None:
            options["scheduling_strategy"] = self.placement.teacher_scheduling(index)
        return ray.remote(RolloutEngineActor).options(**options).remote()

    async def score(self, groups: list[list[Any]]) -> dict[str, float]:
        """Put the teacher's log-probs (and top tokens, in topk mode) on every sample; the
        rollout's `opd/*` metrics."""
        assert self.pool is not None, "start() before score()"
        await score_with_teacher(self.pool, groups, self.config.distillation.teacher_top_k)
        return teacher_kl_metrics(groups)

    async def dispose(self) -> None:
        if self.pool is not None:
            await self.pool.aclose()
            self.pool = None
        if self.actors:
            stops = asyncio.gather(*[actor.shutdown.remote() for actor in self.actors])
            try:
                await asyncio.wait_for(stops, 60)
            except Exception as err:  # a hung or dead actor: killed below
                logger.warning("stopping the teacher engines: %s", describe(err))
            for actor in self.actors:
                ray.kill(actor)
            self.actors = []
