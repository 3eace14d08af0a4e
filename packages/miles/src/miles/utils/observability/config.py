"""`ObservabilityConfig`, the `observability` group: MLflow, Prometheus, profiling and memory flags.

The flags keep upstream miles' spellings. Each is checked here, before anything starts: a missing
optional package, a malformed tag or window, and a setting that its switch would leave unread.
Checks against other groups (the run's length, whether it has engines) are in
`miles.config.cross_checks.check_observability`.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

PROFILE_TARGETS = ("train", "rollout-manager", "engine")
"""What --profile-target can name: the train ranks (torch.profiler), the rollout manager
(py-spy), the engines (their own profiler, SGLang's /start_profile)."""


@dataclass(kw_only=True)
class ObservabilityConfig:
    """MLflow tracking, the Prometheus endpoint, profiler traces and memory records; all off by
    default (docs/guides/observability.md)."""

    use_mlflow: bool = False
    """Also log to MLflow: the resolved config as params, each rollout's metrics (the rollout id
    is the step), the plots and failure.log as artifacts; a resumed run continues its MLflow run
    (needs `miles[mlflow]`)."""
    mlflow_tracking_uri: str | None = None
    """Where MLflow keeps runs: a tracking server (http://host:5000) or a database URI; default
    $MLFLOW_TRACKING_URI, else an SQLite store under --output-dir (mlflow/), which needs no
    server (`mlflow ui --backend-store-uri sqlite:///<output-dir>/mlflow/mlflow.db` shows it)."""
    mlflow_experiment_name: str = "miles"
    """MLflow experiment of the run (created when missing)."""
    mlflow_run_name: str | None = None
    """MLflow run name; default: the --output-dir's name."""
    mlflow_run_id: str | None = None
    """Log into this existing MLflow run; default: a new run, or on resume the run this
    --output-dir logged to (its mlflow_run.json)."""
    mlflow_tags: list[str] | None = None
    """MLflow run tags as key=value items: `--mlflow-tags team=rl model=qwen3`."""
    use_prometheus: bool = False
    """Serve the run's latest metrics at http://<--prometheus-host>:<--prometheus-port>/metrics
    from the driver, as Prometheus gauges and counters (names in docs/guides/observability.md;
    needs `miles[prometheus]`)."""
    prometheus_port: int = 9090
    """Port of the /metrics endpoint (0: any free port, logged at start)."""
    prometheus_host: str = "127.0.0.1"
    """Address the /metrics endpoint listens on: loopback by default; 0.0.0.0 exposes it to
    every host that reaches this machine."""
    profile_target: list[str] | None = None
    """Profile rollouts --profile-step-start .. --profile-step-end - 1 of these processes:
    train (torch.profiler on every train rank), rollout-manager (py-spy, needs
    `miles[profile]`), engine (the engine's own profiler, SGLang's /start_profile). Traces go
    to <output-dir>/profiles/, viewable in Perfetto (ui.perfetto.dev) or TensorBoard."""
    profile_step_start: int = 1
    """First profiled rollout (with --profile-target); the default skips rollout 0's warm-up."""
    profile_step_end: int = 2
    """The rollout after the last profiled one (with --profile-target)."""
    memory_snapshot_dir: str | None = None
    """Record memory into this directory: each process's peak resident memory per phase of
    every rollout (peak_rss.jsonl, and the metrics memory/<process>/peak_rss_mb), and on GPUs
    each train rank's CUDA allocation history as a snapshot (pytorch.org/memory_viz reads it)."""
    memory_snapshot_num_steps: int = 1
    """With --memory-snapshot-dir on GPUs: the CUDA snapshots are taken after this many rollouts
    (the history is recorded until then), and at an out-of-memory error."""

    def __post_init__(self) -> None:
        self._check_mlflow()
        if not 0 <= self.prometheus_port <= 65535:
            raise ValueError(
                f"--prometheus-port must be a TCP port (1-65535, or 0 for any free one), got "
                f"{self.prometheus_port}"
            )
        if not self.prometheus_host:
            raise ValueError("--prometheus-host is empty; give an address, e.g. 127.0.0.1")
        if self.use_prometheus and importlib.util.find_spec("prometheus_client") is None:
            raise ImportError(
                "--use-prometheus needs the prometheus_client package; run "
                "`uv pip install 'miles[prometheus]'`"
            )
        if not self.use_prometheus:
            _unread("--prometheus-port", self.prometheus_port != 9090, "--use-prometheus")
            _unread("--prometheus-host", self.prometheus_host != "127.0.0.1", "--use-prometheus")
        self._check_profile()
        if self.memory_snapshot_num_steps < 1:
            raise ValueError(
                f"--memory-snapshot-num-steps must be >= 1, got {self.memory_snapshot_num_steps}"
            )
        if self.memory_snapshot_dir is None:
            _unread(
                "--memory-snapshot-num-steps", self.memory_snapshot_num_steps != 1,
                "--memory-snapshot-dir DIR",
            )  # fmt: skip

    def _check_mlflow(self) -> None:
        for item in self.mlflow_tags or []:
            key, sep, _ = item.partition("=")
            if not sep or not key:
                raise ValueError(
                    f"--mlflow-tags takes key=value items, got {item!r}; e.g. --mlflow-tags "
                    "team=rl model=qwen3"
                )
        if not self.mlflow_experiment_name:
            raise ValueError("--mlflow-experiment-name is empty; name an experiment, e.g. miles")
        if self.use_mlflow:
            if importlib.util.find_spec("mlflow") is None:
                raise ImportError(
                    "--use-mlflow needs the mlflow package; run `uv pip install 'miles[mlflow]'`"
                )
            return
        for flag, given in (
            ("--mlflow-tracking-uri", self.mlflow_tracking_uri is not None),
            ("--mlflow-run-name", self.mlflow_run_name is not None),
            ("--mlflow-run-id", self.mlflow_run_id is not None),
            ("--mlflow-tags", bool(self.mlflow_tags)),
            ("--mlflow-experiment-name", self.mlflow_experiment_name != "miles"),
        ):
            _unread(flag, given, "--use-mlflow")

    def _check_profile(self) -> None:
        targets = self.profile_target or []
        unknown = [t for t in targets if t not in PROFILE_TARGETS]
        if unknown:
            raise ValueError(
                f"--profile-target {' '.join(unknown)}: not a profiling target; choose from "
                f"{', '.join(PROFILE_TARGETS)}"
            )
        if not targets:
            _unread("--profile-step-start", self.profile_step_start != 1, "--profile-target")
            _unread("--profile-step-end", self.profile_step_end != 2, "--profile-target")
            return
        if self.profile_step_start < 0 or self.profile_step_end <= self.profile_step_start:
            raise ValueError(
                f"--profile-step-start ({self.profile_step_start}) and --profile-step-end "
                f"({self.profile_step_end}) must give rollouts start .. end - 1 with 0 <= start "
                f"< end; e.g. --profile-step-start 1 --profile-step-end 2 profiles rollout 1"
            )
        if "rollout-manager" in targets and py_spy_path() is None:
            raise ImportError(
                "--profile-target rollout-manager samples the rollout manager with py-spy, "
                "which is not installed; run `uv pip install 'miles[profile]'`"
            )

    @property
    def profiles(self) -> tuple[str, ...]:
        """The --profile-target processes, in a fixed order."""
        return tuple(t for t in PROFILE_TARGETS if t in (self.profile_target or []))

    @property
    def records_memory(self) -> bool:
        return self.memory_snapshot_dir is not None

    @property
    def enabled(self) -> bool:
        """Whether anything of this group is on (nothing of it is imported otherwise)."""
        return self.use_mlflow or self.use_prometheus or bool(self.profiles) or self.records_memory

    @property
    def tags(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.mlflow_tags or [])


def py_spy_path() -> str | None:
    """The py-spy executable: beside this interpreter (a virtual environment), else on $PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def _unread(flag: str, given: bool, switch: str) -> None:
    if given:
        raise ValueError(f"{flag} is only read with {switch}; add {switch} or drop {flag}")
