"""MLflow tracking of a run (--use-mlflow): one MLflow run per miles run, resumed runs included.

The resolved config goes in as params, each rollout's numbers as metrics with the rollout id as the
step, and at the end the plots and config.json as artifacts (`failure.log` too, when the run
failed: `attach_failure_log`). Without --mlflow-tracking-uri or $MLFLOW_TRACKING_URI the store is
SQLite under the output directory, so nothing needs a server. The run's id is kept in
`<output-dir>/mlflow_run.json`: a resumed run logs into the same MLflow run. Metrics go out in
MLflow's background queue, so a rollout never waits for the store.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles.utils.observability.config import ObservabilityConfig

logger = logging.getLogger(__name__)

RUN_POINTER = "mlflow_run.json"
# MLflow's own limits: params per batch, characters per param value.
_PARAMS_PER_BATCH = 100
_MAX_PARAM_CHARS = 6000


def embedded_store(output_dir: str | Path) -> str:
    """The default tracking URI: an SQLite database under the run's output directory."""
    return f"sqlite:///{Path(output_dir).resolve() / 'mlflow' / 'mlflow.db'}"


def metric_key(key: str) -> str:
    """A miles metric name as MLflow accepts it (letters, digits, _ - . / and spaces):
    `eval/gsm8k/pass@1` becomes `eval/gsm8k/pass_at_1`."""
    return re.sub(r"[^\w\-. /]", "_", key.replace("@", "_at_"))


@dataclass(frozen=True)
class MlflowRunRef:
    """Which MLflow run a miles run logs into (the contents of mlflow_run.json)."""

    tracking_uri: str
    experiment_id: str
    run_id: str

    @classmethod
    def read(cls, output_dir: str | Path) -> MlflowRunRef | None:
        path = Path(output_dir) / RUN_POINTER
        return cls(**json.loads(path.read_text())) if path.is_file() else None

    def write(self, output_dir: str | Path) -> None:
        (Path(output_dir) / RUN_POINTER).write_text(json.dumps(self.__dict__, indent=2) + "\n")


class MlflowTracking:
    """A tracker sink (`miles.utils.tracking.MetricSink`) logging into one MLflow run."""

    def __init__(
        self,
        settings: ObservabilityConfig,
        output_dir: str | Path,
        *,
        run_config: dict[str, Any],
        resuming: bool,
    ) -> None:
        from mlflow import MlflowClient  # seconds of imports: only with --use-mlflow

        self.output_dir = Path(output_dir)
        uri = (
            settings.mlflow_tracking_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or embedded_store(self.output_dir)
        )
        if uri.startswith("sqlite:///"):
            Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self._client = MlflowClient(tracking_uri=uri)
        earlier = MlflowRunRef.read(self.output_dir) if resuming else None
        if settings.mlflow_run_id is not None:
            run = self._client.get_run(settings.mlflow_run_id)
            self.ref = MlflowRunRef(uri, run.info.experiment_id, run.info.run_id)
        elif earlier is not None and earlier.tracking_uri == uri:
            self.ref = earlier
        else:
            self.ref = self._new_run(settings, uri)
        continued = self.ref is earlier or settings.mlflow_run_id is not None
        if continued:
            self._client.update_run(self.ref.run_id, status="RUNNING")
        self.ref.write(self.output_dir)
        self._log_params(run_config, continued=continued)
        self._pending: list[Any] = []
        logger.info(
            "MLflow: %s run %s of experiment %s at %s",
            "continuing" if continued else "logging to", self.ref.run_id,
            settings.mlflow_experiment_name, uri,
        )  # fmt: skip

    def _new_run(self, settings: ObservabilityConfig, uri: str) -> MlflowRunRef:
        name = settings.mlflow_experiment_name
        experiment = self._client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        elif uri == embedded_store(self.output_dir):
            # Artifacts beside the database, so the whole store is one folder of the run.
            artifacts = (self.output_dir / "mlflow" / "artifacts").resolve().as_uri()
            experiment_id = self._client.create_experiment(name, artifact_location=artifacts)
        else:
            experiment_id = self._client.create_experiment(name)
        run = self._client.create_run(
            experiment_id,
            run_name=settings.mlflow_run_name or self.output_dir.name,
            tags={**settings.tags, "miles.output_dir": str(self.output_dir)},
        )
        return MlflowRunRef(uri, experiment_id, run.info.run_id)

    def _log_params(self, run_config: dict[str, Any], *, continued: bool) -> None:
        """Every setting as a param. MLflow never changes a param: on resume, a setting that
        changed since (a longer --num-rollout, say) is recorded as a tag instead."""
        from mlflow.entities import Param, RunTag

        values = {k: _param_value(v) for k, v in run_config.items()}
        known = self._client.get_run(self.ref.run_id).data.params if continued else {}
        new = [Param(k, v) for k, v in values.items() if k not in known]
        changed = {
            k: f"{known[k]} -> {v}" for k, v in values.items() if k in known and known[k] != v
        }
        for start in range(0, len(new), _PARAMS_PER_BATCH):
            self._client.log_batch(self.ref.run_id, params=new[start : start + _PARAMS_PER_BATCH])
        if changed:
            tags = [RunTag(f"miles.changed_on_resume.{k}", v) for k, v in changed.items()]
            self._client.log_batch(self.ref.run_id, tags=tags)

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        from mlflow.entities import Metric

        now_ms = _now_ms()
        batch = [
            Metric(metric_key(k), float(v), now_ms, step)
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        ]
        if batch:
            # Queued: MLflow's worker thread writes it while the next rollout runs.
            self._pending.append(
                self._client.log_batch(self.ref.run_id, metrics=batch, synchronous=False)
            )

    def close(self, *, failed: bool = False) -> None:
        """Wait for the queued metrics, add the plots and config as artifacts, end the run."""
        for operation in self._pending:
            operation.wait()
        self._pending = []
        self._log_run_artifacts()
        self._client.set_terminated(self.ref.run_id, status="FAILED" if failed else "FINISHED")

    def _log_run_artifacts(self) -> None:
        from miles.utils.plotting import plot_run

        config = self.output_dir / "config.json"
        if config.is_file():
            self._client.log_artifact(self.ref.run_id, str(config))
        try:
            plots = plot_run(self.output_dir)
        except (FileNotFoundError, ValueError) as err:  # no rollout finished: nothing to plot
            logger.info("MLflow: no plots to attach (%s)", err)
            return
        self._client.log_artifacts(self.ref.run_id, str(plots[0].parent), artifact_path="plots")


def attach_failure_log(output_dir: str | Path, failure_log: str | Path) -> str | None:
    """Add a failed run's failure.log to its MLflow run (named by mlflow_run.json) and mark the
    run failed; the run id, or None when the run logged to no MLflow run."""
    ref = MlflowRunRef.read(output_dir)
    if ref is None:
        return None
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=ref.tracking_uri)
    client.log_artifact(ref.run_id, str(failure_log))
    client.set_terminated(ref.run_id, status="FAILED")
    return ref.run_id


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > _MAX_PARAM_CHARS:
        text = text[: _MAX_PARAM_CHARS - 20] + " ... (cut; config.json)"
    return text


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)
