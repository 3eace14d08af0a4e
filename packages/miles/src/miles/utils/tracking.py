"""Where a run's metrics go: a JSONL file always, TensorBoard and Weights & Biases when asked.

`<output_dir>/metrics.jsonl` holds one JSON object per logged step (`{"rollout_id": N, ...}`) and is
what `miles plot` reads. Appending to an existing file (a resumed run) first moves the lines of
rollouts at or after the resume point into a file of their own beside it, so the file never holds
one rollout twice and nothing written is lost.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


class JsonlWriter:
    """Append-only metrics file, flushed per line so a crash loses at most the last line."""

    def __init__(self, path: str | Path, *, resume_from: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from is not None and self.path.exists():
            self._truncate(resume_from)
        self._file = self.path.open("a")

    def _truncate(self, resume_from: int) -> None:
        records = read_metrics(self.path)
        kept = [r for r in records if r.get("rollout_id", -1) < resume_from]
        dropped = [r for r in records if r.get("rollout_id", -1) >= resume_from]
        if dropped:
            # The resumed run logs these rollouts again; the first attempt's lines stay on disk.
            backup = unused_sibling(self.path, "dropped")
            backup.write_text("".join(json.dumps(r) + "\n" for r in dropped))
            logger.info(
                "resuming at rollout %d: %d earlier records of rollouts >= %d moved to %s",
                resume_from, len(dropped), resume_from, backup,
            )  # fmt: skip
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(_finite(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def unused_sibling(path: Path, reason: str) -> Path:
    """A free name beside `path` for a copy of its records: `metrics.<reason>-<time>.jsonl`,
    numbered when taken (two restarts within one second)."""
    label = f"{reason}-{time.strftime('%Y%m%dT%H%M%S')}"
    candidate = path.with_name(f"{path.stem}.{label}{path.suffix}")
    number = 1
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.stem}.{label}-{number}{path.suffix}")
    return candidate


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl file; a torn last line (a crash mid-write) is skipped."""
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("%s line %d is not JSON (torn write?); skipping it", path, number)
    return records


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN or infinity; write null so every reader can parse the file.
    return {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()
    }


class MetricSink(Protocol):
    """Another place a run's records go (MLflow, the Prometheus endpoint:
    `miles.utils.observability`); the tracker hands each one every record."""

    def log(self, metrics: dict[str, Any], *, step: int) -> None: ...

    def close(self, *, failed: bool = False) -> None:
        """Flush and release; `failed`: the run ended with an error."""
        ...


class Tracker:
    """Fan-out of metrics to the JSONL file, the optional TensorBoard / W&B backends and any
    further sinks."""

    def __init__(
        self,
        output_dir: str | Path,
        *,
        use_tensorboard: bool = False,
        use_wandb: bool = False,
        wandb_project: str = "miles",
        wandb_mode: str = "offline",
        wandb_run_name: str | None = None,
        run_config: dict[str, Any] | None = None,
        resume_from: int | None = None,
        sinks: Sequence[MetricSink] = (),
    ):
        self.output_dir = Path(output_dir)
        self.sinks = list(sinks)
        self.jsonl = JsonlWriter(self.output_dir / METRICS_FILE, resume_from=resume_from)
        self._tensorboard = _open_tensorboard(self.output_dir) if use_tensorboard else None
        self._wandb = (
            _open_wandb(self.output_dir, wandb_project, wandb_mode, wandb_run_name, run_config)
            if use_wandb
            else None
        )
        if run_config is not None:
            (self.output_dir / "config.json").write_text(json.dumps(run_config, indent=2))

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        """Record `metrics` of rollout `step` everywhere."""
        self.jsonl.log({"rollout_id": step, **metrics})
        numbers = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        if self._tensorboard is not None:
            for key, value in numbers.items():
                self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)
        for sink in self.sinks:
            sink.log(metrics, step=step)

    def close(self, *, failed: bool = False) -> None:
        self.jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
        for sink in self.sinks:
            try:
                sink.close(failed=failed)
            except Exception:  # one sink's failure must not keep the others open
                logger.exception("closing the metric sink %s", type(sink).__name__)


def _open_tensorboard(output_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            f"--use-tensorboard needs the tensorboard package ({exc}); run "
            "`uv pip install 'miles[tensorboard]'`"
        ) from None
    return SummaryWriter(log_dir=str(output_dir / "tensorboard"))


def _open_wandb(
    output_dir: Path, project: str, mode: str, name: str | None, config: dict | None
) -> Any:
    try:
        import wandb
    except ImportError:
        raise ImportError(
            "--use-wandb needs the wandb package; run `uv pip install 'miles[wandb]'`"
        ) from None
    return wandb.init(
        project=project, name=name, mode=mode, dir=str(output_dir), config=config or {}
    )
