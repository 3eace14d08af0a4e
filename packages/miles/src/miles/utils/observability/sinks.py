"""The tracker sinks the observability flags ask for: MLflow (--use-mlflow) and the Prometheus
endpoint (--use-prometheus).

MLflow's client takes seconds to import and to open its store, so it opens in a thread from the
start of the run and is ready by the time the first record is logged; the start-up does not wait
for it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from miles.utils.observability.config import ObservabilityConfig
from miles.utils.tracking import MetricSink


class ObservabilitySinks:
    def __init__(
        self,
        settings: ObservabilityConfig,
        output_dir: str | Path,
        *,
        run_config: dict[str, Any],
        resuming: bool,
    ) -> None:
        self.settings = settings
        self._mlflow: Future | None = None
        if settings.use_mlflow:
            from miles.utils.observability.mlflow_tracking import MlflowTracking

            pool = ThreadPoolExecutor(1, thread_name_prefix="mlflow-open")
            self._mlflow = pool.submit(
                MlflowTracking, settings, output_dir, run_config=run_config, resuming=resuming
            )
            pool.shutdown(wait=False)  # the thread ends with the task

    def ready(self, *, num_engines: int) -> list[MetricSink]:
        """The sinks, open (waiting for MLflow if it is still opening)."""
        sinks: list[MetricSink] = []
        if self._mlflow is not None:
            sinks.append(self._mlflow.result())
            self._mlflow = None
        if self.settings.use_prometheus:
            from miles.utils.observability.prometheus_metrics import PrometheusEndpoint

            sinks.append(PrometheusEndpoint(self.settings, num_engines=num_engines))
        return sinks

    def abandon(self) -> None:
        """The run failed before its tracker opened: end the MLflow run that was opening."""
        if self._mlflow is not None and self._mlflow.exception() is None:
            self._mlflow.result().close(failed=True)
        self._mlflow = None
