"""`miles report RUN_DIR`: one self-contained HTML page about a run, read from its output directory.

What it reads: config.json (the resolved config), metrics.jsonl (curves, time split, start-up,
engine restarts and failures, held-out evaluation), the memory record of --memory-snapshot-dir
(peak_rss.jsonl), failure.log, and the traces under profiles/. The curves are `miles plot`'s
PNGs, embedded; the page loads nothing from anywhere else. `report_html` lays it out and
writes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.utils.failures import FAILURE_LOG
from miles.utils.observability import memory_record
from miles.utils.tracking import METRICS_FILE, read_metrics

TIME_SPLIT = (
    ("generate", "time/generate_s"),
    ("train", "time/train_s"),
    ("update weights", "time/update_weights_s"),
    ("save", "time/save_s"),
    ("eval", "time/eval_s"),
)
"""The parts of a step's wall time (time/step_s) the report shows; the rest is "other"."""

FAULT_KEYS = (
    "engine/restarts", "engine/reissued_requests", "engine/seconds_lost", "engine/serving",
    "rollout/reissued_groups", "reward/failures", "train/skipped_steps",
)  # fmt: skip
"""Per rollout: engine restarts (running totals), reward failures and skipped steps."""

_FAILURE_LOG_CHARS = 20_000


@dataclass
class RunFacts:
    """Everything the report shows, read from one run directory."""

    run_dir: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]
    plots: dict[str, bytes] = field(default_factory=dict)  # panel -> PNG
    memory: list[dict[str, Any]] = field(default_factory=list)  # the per-phase record
    failure_log: str | None = None
    traces: list[str] = field(default_factory=list)  # paths relative to the run directory

    @property
    def rollouts(self) -> list[dict[str, Any]]:
        """The records of training rollouts (not the evaluation before training)."""
        return [r for r in self.records if r.get("rollout_id", -1) >= 0]

    def startup(self) -> dict[str, float]:
        for record in self.records:
            phases = {k.removeprefix("startup/"): v for k, v in record.items()
                      if k.startswith("startup/") and k != "startup/began_at"}  # fmt: skip
            if phases:
                return phases
        return {}

    def time_split(self) -> list[dict[str, Any]]:
        """Per rollout: each part's seconds, "other" and the step's wall time."""
        rows = []
        for record in self.rollouts:
            step = record.get("time/step_s")
            if step is None:
                continue
            parts = {name: float(record.get(key) or 0.0) for name, key in TIME_SPLIT}
            rows.append({"rollout_id": record["rollout_id"], **parts,
                         "other": max(0.0, step - sum(parts.values())), "step": step})  # fmt: skip
        return rows

    def faults(self) -> list[dict[str, Any]]:
        return [
            {"rollout_id": r["rollout_id"], **{k: r[k] for k in FAULT_KEYS if k in r}}
            for r in self.rollouts
            if any(k in r for k in FAULT_KEYS)
        ]

    def evaluations(self) -> tuple[list[str], list[dict[str, Any]]]:
        """(columns, one row per evaluated rollout): each dataset's mean reward, pass@k, samples
        and mean response length, and the mean reward over the datasets."""
        rows = [r for r in self.records if any(k.startswith("eval/") for k in r)]
        shown = ("/reward_mean", "/samples", "/response_len_mean")
        columns = sorted({k for r in rows for k in r
                          if k.startswith("eval/") and (k.endswith(shown) or "/pass@" in k)})  # fmt: skip
        return columns, rows

    def peak_memory(self) -> dict[str, dict[str, float]]:
        """{process: {phase: peak MB over the run}}, from the per-phase record, else from the
        rollouts' memory/<process>/peak_rss_mb metrics (phase "any")."""
        peaks: dict[str, dict[str, float]] = {}
        for line in self.memory:
            phases = peaks.setdefault(line["process"], {})
            phases[line["phase"]] = max(phases.get(line["phase"], 0.0), line["peak_rss_mb"])
        if not peaks:
            for record in self.rollouts:
                for key, value in record.items():
                    if key.startswith("memory/") and key.endswith("/peak_rss_mb"):
                        process = key.split("/")[1]
                        phases = peaks.setdefault(process, {})
                        phases["any"] = max(phases.get("any", 0.0), value)
        return peaks


def read_run(run_dir: str | Path) -> RunFacts:
    """Everything the report shows; FileNotFoundError when `run_dir` holds no run."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise FileNotFoundError(
            f"{run_dir} has no {METRICS_FILE}; pass the --output-dir of a miles train run"
        )
    config_path = run_dir / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    facts = RunFacts(run_dir=run_dir, config=config, records=read_metrics(metrics_path))
    facts.plots = _plots(run_dir)
    snapshot_dir = config.get("memory_snapshot_dir")
    if snapshot_dir:
        facts.memory = memory_record.read_record(snapshot_dir)
    failure = run_dir / FAILURE_LOG
    if failure.is_file():
        facts.failure_log = failure.read_text()[-_FAILURE_LOG_CHARS:]
    profiles = run_dir / "profiles"
    if profiles.is_dir():
        facts.traces = sorted(
            str(p.relative_to(run_dir)) for p in profiles.rglob("*") if p.is_file()
        )
    return facts


def _plots(run_dir: Path) -> dict[str, bytes]:
    """`miles plot`'s PNGs, made into a temporary folder (the run's plots/ stays as it is)."""
    import tempfile

    from miles.utils.plotting import plot_run

    with tempfile.TemporaryDirectory() as tmp:
        try:
            paths = plot_run(run_dir, tmp)
        except ValueError:  # no plotted metric yet
            return {}
        return {path.stem: path.read_bytes() for path in paths}
