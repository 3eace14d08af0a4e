"""Divergence and collapse, found while the run goes on instead of after it.

`DivergenceGuard` reads the metrics the loop already has. Two kinds of trouble:
- **Divergence**: the trainers skip an optimizer step whose gradient norm is not finite; the
  weights and the optimizer state are left as they were. One such step is a glitch. Several in a
  row (`--max-consecutive-nonfinite-steps`) mean the run cannot go on, so it stops, naming the
  rollouts and the last finite step's metrics.
- **Collapse**: the run goes on, but nothing is learned. One of these holds for
  `--collapse-window` rollouts in a row: the policy's entropy is back near ln(vocabulary)
  (uniform output) after it was below it in this run (a randomly initialised model starts
  there: that is no collapse), every gradient norm is exactly 0, or every reward equals the
  lowest seen so far. It is logged as a warning, or stops the run with `--abort-on-collapse`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence

from miles.utils.hf_config import hf_config_value

logger = logging.getLogger(__name__)

# Entropy within 1% of ln(V) is as good as uniform: a trained model sits far below it.
_UNIFORM_ENTROPY_FRACTION = 0.99


class DivergenceError(RuntimeError):
    """The run stopped: its optimizer steps keep failing, or (when asked) its policy collapsed."""


@dataclasses.dataclass
class DivergenceGuard:
    max_consecutive_nonfinite_steps: int
    """Stop after this many optimizer steps in a row with a non-finite gradient norm."""
    collapse_window: int
    """Rollouts in a row a collapse signal must hold before it is reported."""
    abort_on_collapse: bool = False
    """Stop the run on collapse instead of warning."""
    vocab_size: int | None = None
    """The model's vocabulary size (for the uniform-entropy signal); None skips that signal."""

    _skipped: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    _last_finite: tuple[int, dict[str, float]] | None = None
    _lowest_reward: float = math.inf
    _left_uniform: bool = False  # the policy's entropy was below ln(V)'s threshold in this run
    _streaks: dict[str, int] = dataclasses.field(default_factory=dict)

    def record_steps(self, rollout_id: int, steps: Sequence[Mapping[str, float]]) -> int:
        """Read each optimizer step's metrics, in order; returns how many were skipped (the
        checks come in `check`, after the rollout's record is logged, so a stopped run has it)."""
        skipped = 0
        for step in steps:
            if "train/grad_norm" not in step:
                continue  # the critic trained alone (--num-critic-only-steps)
            if math.isfinite(step["train/grad_norm"]):
                self._skipped.clear()
                self._last_finite = (rollout_id, dict(step))
            else:
                self._skipped.append((rollout_id, int(step.get("train/step", -1))))
                skipped += 1
        return skipped

    def check(self, rollout_id: int, metrics: Mapping[str, float]) -> None:
        """Raise DivergenceError at the limit of skipped steps; warn (or raise) on a collapse
        signal that held for `collapse_window` rollouts in a row."""
        if len(self._skipped) >= self.max_consecutive_nonfinite_steps:
            raise DivergenceError(self._divergence_message())
        for signal, holds in self._collapse_signals(metrics).items():
            self._streaks[signal] = self._streaks.get(signal, 0) + 1 if holds else 0
            if self._streaks[signal] != self.collapse_window:
                continue  # reported once per streak, when it reaches the window
            message = (
                f"the policy looks collapsed: {signal} for {self.collapse_window} rollouts in a "
                f"row (through rollout {rollout_id}); check --lr and the reward function"
            )
            if self.abort_on_collapse:
                raise DivergenceError(f"{message}; stopping (--abort-on-collapse)")
            logger.warning("%s; pass --abort-on-collapse to stop such runs", message)

    def _collapse_signals(self, metrics: Mapping[str, float]) -> dict[str, bool]:
        signals = {}
        entropy = metrics.get("train/entropy")
        if self.vocab_size and entropy is not None:
            uniform = math.log(self.vocab_size)
            at_uniform = entropy >= _UNIFORM_ENTROPY_FRACTION * uniform
            self._left_uniform = self._left_uniform or not at_uniform
            signals[f"entropy back at ln(V) = {uniform:.3f} (uniform output)"] = (
                at_uniform and self._left_uniform
            )
        grad_norm = metrics.get("train/grad_norm")
        if grad_norm is not None:
            signals["gradient norm exactly 0"] = grad_norm == 0.0
        low, high = metrics.get("rollout/reward_min"), metrics.get("rollout/reward_max")
        if low is not None and high is not None:
            self._lowest_reward = min(self._lowest_reward, low)
            signals[f"every reward at the lowest seen ({self._lowest_reward:g})"] = (
                high == low == self._lowest_reward
            )
        return signals

    def _divergence_message(self) -> str:
        where = ", ".join(f"rollout {r} step {s}" for r, s in self._skipped)
        if self._last_finite is None:
            last = "no step of this run had a finite gradient norm"
        else:
            rollout_id, step = self._last_finite
            shown = {k: round(v, 6) for k, v in step.items() if isinstance(v, int | float)}
            last = f"the last finite step (rollout {rollout_id}): {shown}"
        return (
            f"{len(self._skipped)} optimizer steps in a row had a non-finite gradient norm and "
            f"were skipped ({where}); {last}. Lower --lr (the usual cause), or raise "
            "--max-consecutive-nonfinite-steps to tolerate more"
        )


def vocab_size(hf_checkpoint: str) -> int | None:
    """The model's vocabulary size from a local checkpoint; None for a hub id."""
    size = hf_config_value(hf_checkpoint, "vocab_size")
    return int(size) if size else None
