"""`miles train`: the RL loop of DESIGN §4, synchronous or one step asynchronous.

    generate -> (offload engines) -> train -> save? -> (offload trainer) -> update_weights -> eval?

The pieces live elsewhere (placement, rollout manager, train group, tracking); this module only
decides their order. Async mode overlaps generating rollout N+1 with training on rollout N and
waits for that generation before every weight update, so an update never meets a request in flight.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from miles.config.schema import MilesConfig
from miles.ray.run import Run

logger = logging.getLogger(__name__)


def train(config: MilesConfig) -> dict[str, Any]:
    """Run the whole training; returns the last rollout's metrics."""
    with Run(config) as run:
        loop = train_async if config.training.async_train else train_sync
        return loop(run)


def train_sync(run: Run) -> dict[str, Any]:
    config, metrics = run.config, {}
    run.initial_weight_update()
    run.maybe_eval(run.start_rollout_id, before_training=True)
    for rollout_id in range(run.start_rollout_id, run.num_rollout):
        step_start = time.perf_counter()
        data = run.generate(rollout_id)
        if config.cluster.colocate:
            run.offload_engines()
        run.check_weight_sync(rollout_id, data)
        run.train(rollout_id, data)
        run.maybe_save(rollout_id)
        if config.cluster.colocate:
            run.offload_trainer_and_onload_engines()
        run.update_weights()
        run.maybe_eval(rollout_id)
        metrics = run.finish_rollout(rollout_id, time.perf_counter() - step_start)
    return metrics


def train_async(run: Run) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    run.initial_weight_update()
    run.maybe_eval(run.start_rollout_id, before_training=True)
    next_data = run.start_generate(run.start_rollout_id)
    for rollout_id in range(run.start_rollout_id, run.num_rollout):
        step_start = time.perf_counter()
        data = run.wait_generate(next_data)
        run.check_weight_sync(rollout_id, data)
        next_data = run.start_generate(rollout_id + 1) if rollout_id + 1 < run.num_rollout else None
        run.train(rollout_id, data)  # overlaps generation of rollout_id + 1
        run.maybe_save(rollout_id)
        if next_data is not None:
            # The update waits for the generation in flight: weights never change mid-request.
            next_data = run.wait_generate(next_data, ready=True)
        run.update_weights()
        run.maybe_eval(rollout_id)
        metrics = run.finish_rollout(rollout_id, time.perf_counter() - step_start)
    return metrics
