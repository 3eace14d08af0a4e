"""The Prometheus endpoint of a run (--use-prometheus): the driver serves /metrics with the run's
latest metrics as gauges and its running totals as counters.

`SERIES` is the whole public surface: each name, kind and help text is stable, listed in
docs/guides/observability.md (a test holds the two together), and read from one key of the
rollout's record. The endpoint listens on loopback unless --prometheus-host says otherwise. The
values change once per logged rollout, when the tracker hands the record over.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from miles.utils.observability.config import ObservabilityConfig

logger = logging.getLogger(__name__)

STEP = "rollout_id"
"""The pseudo-key of a record's rollout id (the tracker's step)."""


@dataclass(frozen=True)
class Series:
    """One exported series and where its value comes from.

    `source` is a key of the rollout's record (empty: set once, at start). A gauge takes the latest value. A counter adds
    the value (`per_rollout`: the record counts this rollout only) or follows a running total
    (`running_total`: the record counts since the run started, so the counter adds the increase).
    """

    name: str
    kind: Literal["gauge", "counter"]
    help: str
    source: str
    counts: Literal["per_rollout", "running_total", "one"] = "per_rollout"


SERIES: tuple[Series, ...] = (
    Series(
        "miles_rollout_id",
        "gauge",
        "Id of the last rollout logged (-1: the evaluation before training).",
        STEP,
    ),
    Series(
        "miles_reward_mean",
        "gauge",
        "Mean reward of the last rollout's samples.",
        "rollout/reward_mean",
    ),
    Series(
        "miles_eval_reward_mean",
        "gauge",
        "Mean held-out reward over the eval datasets, last evaluation.",
        "eval/reward_mean",
    ),
    Series(
        "miles_response_length_mean",
        "gauge",
        "Mean response length in tokens, last rollout.",
        "rollout/response_len_mean",
    ),
    Series(
        "miles_step_seconds", "gauge", "Wall time of the last rollout's whole step.", "time/step_s"
    ),
    Series(
        "miles_generate_seconds",
        "gauge",
        "Seconds the last step waited for its rollout (generation, rewards, train data).",
        "time/generate_s",
    ),
    Series(
        "miles_train_seconds",
        "gauge",
        "Seconds of the last step's optimizer steps.",
        "time/train_s",
    ),
    Series(
        "miles_weight_sync_seconds",
        "gauge",
        "Seconds of the last weight update to the engines.",
        "time/update_weights_s",
    ),
    Series(
        "miles_engines_serving",
        "gauge",
        "Rollout engines in service now (fewer than miles_engines while one restarts).",
        "engine/serving",
    ),
    Series("miles_engines", "gauge", "Rollout engines of the run (set at start).", ""),
    Series(
        "miles_fully_async_buffer_groups",
        "gauge",
        "Groups ready in the fully-async buffer when the last step took its batch (--fully-async).",
        "async/buffer_groups",
    ),
    Series(
        "miles_rollouts_total", "counter", "Rollouts logged by this process.", STEP, counts="one"
    ),
    Series(
        "miles_samples_total",
        "counter",
        "Samples generated and scored for training.",
        "rollout/samples",
    ),
    Series(
        "miles_response_tokens_total",
        "counter",
        "Response tokens generated for training.",
        "rollout/response_tokens",
    ),
    Series(
        "miles_reward_failures_total",
        "counter",
        "Samples whose reward function failed (scored --reward-failure-score).",
        "reward/failures",
    ),
    Series(
        "miles_skipped_steps_total",
        "counter",
        "Optimizer steps skipped for a non-finite gradient norm.",
        "train/skipped_steps",
    ),
    Series(
        "miles_engine_restarts_total",
        "counter",
        "Engine restarts after a lost engine (fault tolerance).",
        "engine/restarts",
        counts="running_total",
    ),
    Series(
        "miles_reissued_requests_total",
        "counter",
        "Requests sent again because their engine was lost.",
        "engine/reissued_requests",
        counts="running_total",
    ),
)


class PrometheusEndpoint:
    """A tracker sink (`miles.utils.tracking.MetricSink`) that serves `SERIES` at /metrics."""

    def __init__(self, settings: ObservabilityConfig, *, num_engines: int) -> None:
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            disable_created_metrics,
            start_http_server,
        )

        # Only the documented names: no `<counter>_created` series beside each counter.
        disable_created_metrics()

        # A registry of the run's own: nothing else of the process (or an earlier run in it)
        # shows up under these names.
        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics: dict[str, Any] = {}
        for series in SERIES:
            kind = Gauge if series.kind == "gauge" else Counter
            # Counter adds `_total` to the exposed name itself.
            name = series.name.removesuffix("_total")
            self._metrics[series.name] = kind(name, series.help, registry=self.registry)
        self._totals: dict[str, float] = {}
        self._num_engines = num_engines
        self._metrics["miles_engines"].set(num_engines)
        self._metrics["miles_engines_serving"].set(num_engines)
        try:
            self._server, self._thread = start_http_server(
                settings.prometheus_port, addr=settings.prometheus_host, registry=self.registry
            )
        except OSError as err:
            raise RuntimeError(
                f"--use-prometheus cannot listen on {settings.prometheus_host}:"
                f"{settings.prometheus_port} ({err}); pick a free --prometheus-port (0: any)"
            ) from None
        host, port = self._server.server_address[:2]
        self.url = f"http://{host}:{port}/metrics"
        logger.info("Prometheus: serving the run's metrics at %s", self.url)

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        record = {**metrics, STEP: step}
        for series in SERIES:
            value = record.get(series.source) if series.source else None
            if not isinstance(value, int | float) or not math.isfinite(value):
                continue
            metric = self._metrics[series.name]
            if series.kind == "gauge":
                metric.set(value)
            elif series.counts == "one":
                if step >= 0:  # the evaluation before training is no rollout
                    metric.inc()
            elif series.counts == "running_total":
                increase = value - self._totals.get(series.name, 0.0)
                self._totals[series.name] = value
                if increase > 0:
                    metric.inc(increase)
            elif value > 0:
                metric.inc(value)

    def close(self, *, failed: bool = False) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
