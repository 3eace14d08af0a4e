"""The two backends schedule the learning rate alike: Megatron's scheduler, built from the shared
schedule flags, gives the FSDP backend's rate at every step for every decay style (wsd included:
Megatron spells it `WSD` and needs its decay phase as `wsd_decay_steps`)."""

from __future__ import annotations

import pytest
import torch

from miles.backends.fsdp_utils.lr_scheduler import LRSchedule
from miles.backends.megatron_utils.arguments import MegatronArgs
from miles.backends.megatron_utils.engine import build_lr_scheduler

SCHEDULES = [
    {"lr_decay_style": "constant"},
    {"lr_decay_style": "constant", "lr_warmup_iters": 3},
    {"lr_decay_style": "linear", "lr_warmup_iters": 2, "min_lr": 1e-4},
    {"lr_decay_style": "cosine", "lr_warmup_iters": 2, "min_lr": 1e-4, "lr_decay_iters": 9},
    {"lr_decay_style": "wsd", "lr_warmup_iters": 2, "min_lr": 1e-4, "lr_wsd_decay_iters": 4},
]
TOTAL_STEPS = 12


@pytest.mark.parametrize("flags", SCHEDULES, ids=lambda f: "-".join(map(str, f.values())))
def test_megatron_follows_the_fsdp_backends_schedule_step_for_step(flags):
    args = MegatronArgs(lr=1e-3, **flags)
    # Megatron's scheduler only reads and writes the optimizer's parameter groups.
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.lr)
    scheduler = build_lr_scheduler(optimizer, args, TOTAL_STEPS)
    decaying = args.lr_decay_style != "constant"
    fsdp = LRSchedule(
        decay_style=args.lr_decay_style, lr=args.lr, min_lr=args.min_lr,
        warmup_iters=args.lr_warmup_iters,
        decay_iters=(args.lr_decay_iters or TOTAL_STEPS) if decaying else None,
        wsd_decay_iters=args.lr_wsd_decay_iters,
    )  # fmt: skip
    rates = []
    for _ in range(TOTAL_STEPS + 2):
        rates.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    assert rates == pytest.approx([fsdp(step) for step in range(TOTAL_STEPS + 2)], abs=1e-12)
