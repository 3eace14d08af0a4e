"""Learning-rate schedules of the FSDP backend: linear warmup, then constant, linear, cosine or WSD.

The formulas follow Megatron-LM's `OptimizerParamScheduler`, so both miles backends give the same
learning rate at the same iteration. An iteration is one optimizer step; the scheduler is stepped
after each `optimizer.step()`. Every parameter group gets the same learning rate.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch.optim.lr_scheduler import LRScheduler

logger = logging.getLogger(__name__)

DecayStyle = Literal["constant", "linear", "cosine", "wsd"]
DECAY_STYLES: tuple[str, ...] = get_args(DecayStyle)
# The user flag behind each LRSchedule field, for messages.
_FLAGS = {
    "decay_style": "--lr-decay-style",
    "lr": "--lr",
    "min_lr": "--min-lr",
    "warmup_iters": "--lr-warmup-iters",
    "decay_iters": "--lr-decay-iters",
    "wsd_decay_iters": "--lr-wsd-decay-iters",
}


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate as a pure function of the iteration (the number of optimizer steps taken).

    Iterations [0, warmup_iters) ramp linearly from 0 towards `lr` (iteration 0 has learning
    rate 0, as in Megatron-LM, so both backends agree step for step); from `warmup_iters` on the
    decay style applies, and from `decay_iters` on the rate stays at `min_lr`:
        constant: lr.
        linear:   lr -> min_lr linearly over [warmup_iters, decay_iters].
        cosine:   min_lr + (lr - min_lr) * (1 + cos(pi * t)) / 2, t in [0, 1] over the same span.
        wsd:      warmup-stable-decay: lr until decay_iters - wsd_decay_iters, then linearly to
                  min_lr at decay_iters.
    """

    decay_style: DecayStyle
    lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int | None
    wsd_decay_iters: int | None = None

    def __post_init__(self) -> None:
        _validate(self)

    def __call__(self, iteration: int) -> float:
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        if iteration < self.warmup_iters:
            return self.lr * iteration / self.warmup_iters
        if self.decay_style == "constant":
            return self.lr
        assert self.decay_iters is not None, "validated in __post_init__"
        if iteration >= self.decay_iters:
            return self.min_lr
        if self.decay_style == "wsd":
            assert self.wsd_decay_iters is not None, "validated in __post_init__"
            anneal_start = self.decay_iters - self.wsd_decay_iters
            if iteration <= anneal_start:
                return self.lr
            progress = (iteration - anneal_start) / self.wsd_decay_iters
            return self.lr - (self.lr - self.min_lr) * progress
        progress = (iteration - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
        if self.decay_style == "linear":
            return self.lr - (self.lr - self.min_lr) * progress
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _validate(s: LRSchedule) -> None:
    if s.decay_style not in DECAY_STYLES:
        raise ValueError(
            f"--lr-decay-style {s.decay_style!r} is not a decay style; use one of "
            f"{', '.join(DECAY_STYLES)}"
        )
    if s.lr < 0 or s.min_lr < 0:
        raise ValueError(f"--lr ({s.lr}) and --min-lr ({s.min_lr}) must be >= 0")
    if s.min_lr > s.lr:
        raise ValueError(
            f"--min-lr ({s.min_lr}) must not exceed --lr ({s.lr}); decay only lowers the rate"
        )
    if s.warmup_iters < 0:
        raise ValueError(f"--lr-warmup-iters must be >= 0, got {s.warmup_iters}")
    if s.decay_style == "constant":
        return
    if s.decay_iters is None or s.decay_iters <= s.warmup_iters:
        raise ValueError(
            f"--lr-decay-style {s.decay_style} needs --lr-decay-iters greater than "
            f"--lr-warmup-iters ({s.warmup_iters}), got {s.decay_iters}; set --lr-decay-iters to "
            "the iteration where the rate reaches --min-lr (usually the total optimizer steps)"
        )
    if s.decay_style == "wsd":
        decay_span = s.decay_iters - s.warmup_iters
        if s.wsd_decay_iters is None or not 0 < s.wsd_decay_iters <= decay_span:
            raise ValueError(
                f"--lr-decay-style wsd needs --lr-wsd-decay-iters in [1, {decay_span}] "
                f"(--lr-decay-iters {s.decay_iters} - --lr-warmup-iters {s.warmup_iters}), got "
                f"{s.wsd_decay_iters}; it is the length of the final decay phase"
            )
    elif s.wsd_decay_iters is not None:
        raise ValueError(
            f"--lr-wsd-decay-iters ({s.wsd_decay_iters}) only applies to --lr-decay-style wsd, "
            f"not {s.decay_style}; drop it or switch to wsd"
        )


class WarmupDecayLR(LRScheduler):
    """Sets every parameter group's learning rate to `schedule(last_epoch)`.

    Unlike `LambdaLR` it stores absolute rates (no factor times the optimizer's initial rate), and
    its `state_dict` carries the schedule itself, so loading a checkpoint restores both the
    position and the shape of the schedule.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LRSchedule) -> None:
        self.schedule = schedule
        super().__init__(optimizer)

    def get_lr(self) -> list[float | torch.Tensor]:
        value = self.schedule(self.last_epoch)
        return [value for _ in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["schedule"] = dict(vars(self.schedule))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore position and schedule; a resumed run follows the schedule it was saved with."""
        state = dict(state_dict)
        schedule = LRSchedule(**state.pop("schedule"))
        changed = [
            f"{_FLAGS[name]} {getattr(self.schedule, name)} -> {value}"
            for name, value in vars(schedule).items()
            if getattr(self.schedule, name) != value
        ]
        if changed:
            logger.warning(
                "the checkpoint's learning-rate schedule replaces the configured one (%s); "
                "resuming continues the schedule the run started with",
                ", ".join(changed),
            )
        super().load_state_dict(state)
        self.schedule = schedule


def get_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    decay_style: DecayStyle,
    lr: float,
    min_lr: float,
    warmup_iters: int,
    decay_iters: int | None,
    wsd_decay_iters: int | None = None,
) -> LRScheduler:
    """A scheduler following `LRSchedule` (see there); step it once after each optimizer step.

    Creating it sets every group's learning rate to the rate of iteration 0.
    """
    schedule = LRSchedule(
        decay_style=decay_style,
        lr=lr,
        min_lr=min_lr,
        warmup_iters=warmup_iters,
        decay_iters=decay_iters,
        wsd_decay_iters=wsd_decay_iters,
    )
    return WarmupDecayLR(optimizer, schedule)
