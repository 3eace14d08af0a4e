"""`miles train`: the RL loop (architecture.md: "The loop"): synchronous, one step asynchronous,
or fully asynchronous.

    generate -> (offload engines) -> train -> save? -> (offload trainer) -> update_weights? -> eval?

The pieces live elsewhere (placement, rollout manager, train group, tracking); this module only
decides their order. Async mode overlaps generating rollout N+1 with training on rollout N and
waits for that generation before every weight update, so an update never meets a request in flight.
Fully-async mode never waits for a generation: the engines fill a bounded buffer in the background
and each step takes a batch from it, within the staleness bound (`miles.rollout.fully_async`).
Weights go to the engines every --update-weights-interval rollouts and after the last.
A stop signal (SIGTERM, SIGINT) ends each loop after the step in progress, with its checkpoint.
The start-up's timings (`startup/*`) are logged with the first rollout's record.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from miles.config.miles_config import MilesConfig
from miles.ray.run import Run
from miles.utils.graceful_stop import GracefulStop

logger = logging.getLogger(__name__)


def train(config: MilesConfig, *, stop: GracefulStop | None = None) -> dict[str, Any]:
    """Run the whole training, or until `stop` is signalled; returns the last rollout's
    metrics."""
    with Run(config, stop=stop) as run:
        if config.training.fully_async:
            return train_fully_async(run)
        loop = train_async if config.training.async_train else train_sync
        return loop(run)


def train_sync(run: Run) -> dict[str, Any]:
    colocate, metrics = run.config.cluster.colocate, {}
    startup = run.initial_weight_update()
    run.evaluate_before_training()
    for rollout_id in range(run.start_rollout_id, run.num_rollout):
        step_start = time.perf_counter()
        rollout = run.generate(rollout_id)
        if colocate:
            run.offload_engines()
        check = run.check_weight_sync(rollout)  # the first rollout only
        trained = run.train(rollout)
        saved = run.maybe_save(rollout_id)
        if colocate:
            run.offload_trainer_and_onload_engines()
        updated = run.update_weights() if run.update_due(rollout_id) else {}
        evaluated = run.maybe_eval(rollout_id)
        parts = (startup, rollout.metrics, check, trained, saved, updated, evaluated)
        metrics, startup = _finish_step(run, rollout_id, step_start, parts), {}
        if run.stop_after(rollout_id):
            break
    return metrics


def train_async(run: Run) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    startup = run.initial_weight_update()
    run.evaluate_before_training()
    pending = run.start_generate(run.start_rollout_id)
    for rollout_id in range(run.start_rollout_id, run.num_rollout):
        step_start = time.perf_counter()
        rollout = run.wait_generate(pending)
        check = run.check_weight_sync(rollout)
        last = rollout_id + 1 == run.num_rollout
        pending = None if last else run.start_generate(rollout_id + 1)
        trained = run.train(rollout)  # overlaps the generation of rollout_id + 1
        saved = run.maybe_save(rollout_id)
        updated = {}
        if run.update_due(rollout_id):
            if pending is not None:
                # The update waits for the generation in flight: weights never change
                # mid-request.
                run.wait_generated(pending)
            updated = run.update_weights()
        evaluated = run.maybe_eval(rollout_id)
        parts = (startup, rollout.metrics, check, trained, saved, updated, evaluated)
        metrics, startup = _finish_step(run, rollout_id, step_start, parts), {}
        if run.stop_after(rollout_id):
            break
    return metrics


def train_fully_async(run: Run) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    startup = run.initial_weight_update()
    run.evaluate_before_training()
    run.start_fully_async()
    for rollout_id in range(run.start_rollout_id, run.num_rollout):
        step_start = time.perf_counter()
        rollout = run.take_rollout(rollout_id)  # generated meanwhile, within the staleness bound
        check = run.check_weight_sync(rollout)
        trained = run.train(rollout)
        saved = run.maybe_save(rollout_id)  # with the buffer: a resumed run loses no sample
        updated = run.update_weights_while_generating() if run.update_due(rollout_id) else {}
        evaluated = run.maybe_eval(rollout_id)
        parts = (startup, rollout.metrics, check, trained, saved, updated, evaluated)
        metrics, startup = _finish_step(run, rollout_id, step_start, parts), {}
        if run.stop_after(rollout_id):
            break
    return metrics


def _finish_step(
    run: Run, rollout_id: int, step_start: float, parts: tuple[dict[str, Any], ...]
) -> dict[str, Any]:
    """Log one rollout's record: its parts merged in order (a later part's key wins), then the
    step's wall time; returns what `Run.finish_rollout` returns."""
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    merged["time/step_s"] = time.perf_counter() - step_start
    return run.finish_rollout(rollout_id, merged)
