"""The live console view of a run: current phase, counters, reward, length and where time goes.

`rich` draws a panel that updates in place on a terminal; `plain` prints one line per rollout, which
is what logs and CI want. Both read the same metric keys the loop records.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Literal

from rich.console import Console
from rich.live import Live
from rich.table import Table

SHOWN = (
    ("reward", "rollout/reward_mean"),
    ("eval reward", "eval/reward_mean"),
    ("response len", "rollout/response_len_mean"),
    ("truncated", "rollout/truncated_ratio"),
    ("loss", "train/loss"),
    ("generate s", "time/generate_s"),
    ("train s", "time/train_s"),
    ("weight sync s", "time/update_weights_s"),
    ("step s", "time/step_s"),
)


class ConsoleView:
    """Shows the run's progress; `update` per phase change, `record` per finished rollout."""

    def __init__(self, num_rollout: int, mode: Literal["auto", "rich", "plain"] = "auto"):
        self.num_rollout = num_rollout
        self.rich = mode == "rich" or (mode == "auto" and sys.stdout.isatty())
        self.phase = "starting"
        self.rollout_id = 0
        self.latest: dict[str, Any] = {}
        self.started = time.monotonic()
        self._console = Console(stderr=False)
        self._live = (
            Live(self._render(), console=self._console, auto_refresh=False) if self.rich else None
        )
        if self._live is not None:
            self._live.start()

    def update(self, phase: str, rollout_id: int | None = None) -> None:
        self.phase = phase
        if rollout_id is not None:
            self.rollout_id = rollout_id
        if self._live is not None:
            self._live.update(self._render(), refresh=True)

    def record(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        self.rollout_id = rollout_id
        self.latest.update(metrics)
        if self._live is not None:
            self._live.update(self._render(), refresh=True)
            return
        shown = [
            f"{label} {_fmt(metrics[key])}" for label, key in SHOWN if metrics.get(key) is not None
        ]
        print(
            f"[miles] rollout {rollout_id + 1}/{self.num_rollout}: " + ", ".join(shown), flush=True
        )

    def _render(self) -> Table:
        elapsed = time.monotonic() - self.started
        table = Table(title=f"miles: {self.phase}", show_header=False, expand=False)
        table.add_row("rollout", f"{self.rollout_id + 1}/{self.num_rollout}")
        table.add_row("elapsed", f"{elapsed:.0f} s")
        for label, key in SHOWN:
            if self.latest.get(key) is not None:
                table.add_row(label, _fmt(self.latest[key]))
        return table

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
