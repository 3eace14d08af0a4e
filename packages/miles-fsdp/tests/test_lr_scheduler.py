"""Each schedule against formulas written out independently here, in float64, over random lengths."""

from __future__ import annotations

import io
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.fsdp_utils.lr_scheduler import get_lr_scheduler


def _reference_lr(it: int, style: str, lr: float, min_lr: float, warmup: int, decay: int, wsd: int):
    """The schedule as a textbook states it (float64 throughout)."""
    if it < warmup:
        return lr * (it / warmup)
    if style == "constant":
        return lr
    if it >= decay:
        return min_lr
    if style == "linear":  # interpolate between (warmup, lr) and (decay, min_lr)
        return min_lr + (lr - min_lr) * (decay - it) / (decay - warmup)
    if style == "cosine":  # half a cosine period from lr down to min_lr
        angle = math.pi * (it - warmup) / (decay - warmup)
        return min_lr + (lr - min_lr) * (math.cos(angle) + 1.0) / 2.0
    stable_until = decay - wsd  # wsd: hold lr, then a straight line to min_lr at `decay`
    if it <= stable_until:
        return lr
    return min_lr + (lr - min_lr) * (decay - it) / wsd


def _run(scheduler, optimizer, iterations: int) -> list[float]:
    """The learning rate each optimizer step would use, for steps 0 .. iterations - 1."""
    lrs = []
    for _ in range(iterations):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=123.0)


schedules = st.fixed_dictionaries(
    {
        "style": st.sampled_from(["constant", "linear", "cosine", "wsd"]),
        "lr": st.floats(1e-7, 1.0),
        "min_fraction": st.floats(0.0, 1.0),
        "warmup": st.integers(0, 20),
        "span": st.integers(1, 40),
        "wsd_fraction": st.floats(0.0, 1.0),
    }
)


@settings(max_examples=80, deadline=None)
@given(schedules)
def test_every_schedule_matches_its_formula_at_every_iteration(s):
    min_lr = s["lr"] * s["min_fraction"]
    decay = s["warmup"] + s["span"]
    wsd = max(1, round(s["span"] * s["wsd_fraction"]))
    optimizer = _optimizer()
    scheduler = get_lr_scheduler(
        optimizer,
        decay_style=s["style"],
        lr=s["lr"],
        min_lr=min_lr if s["style"] != "constant" else 0.0,
        warmup_iters=s["warmup"],
        decay_iters=decay,
        wsd_decay_iters=wsd if s["style"] == "wsd" else None,
    )
    lrs = _run(scheduler, optimizer, decay + 5)
    for it, got in enumerate(lrs):
        want = _reference_lr(it, s["style"], s["lr"], min_lr, s["warmup"], decay, wsd)
        assert got == pytest.approx(want, rel=1e-12, abs=1e-18), f"iteration {it}"
    peak = s["lr"]
    assert all(x <= peak * (1 + 1e-12) for x in lrs)
    after_warmup = lrs[s["warmup"] :]
    assert all(a >= b - 1e-15 for a, b in itertools.pairwise(after_warmup))


def test_warmup_starts_at_zero_and_reaches_the_peak_after_warmup_iters():
    optimizer = _optimizer()
    scheduler = get_lr_scheduler(
        optimizer, decay_style="constant", lr=1.0, min_lr=0.0, warmup_iters=4, decay_iters=None
    )
    assert _run(scheduler, optimizer, 6) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]


@settings(max_examples=30, deadline=None)
@given(schedules, st.integers(0, 70))
def test_state_dict_round_trips_through_torch_save_mid_schedule(s, steps):
    kwargs = {
        "decay_style": s["style"],
        "lr": s["lr"],
        "min_lr": 0.0,
        "warmup_iters": s["warmup"],
        "decay_iters": s["warmup"] + s["span"],
        "wsd_decay_iters": 1 if s["style"] == "wsd" else None,
    }
    optimizer = _optimizer()
    original = get_lr_scheduler(optimizer, **kwargs)
    _run(original, optimizer, steps)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    restored_optimizer = _optimizer()
    restored = get_lr_scheduler(
        restored_optimizer,
        decay_style="constant",
        lr=5.0,
        min_lr=0.0,
        warmup_iters=0,
        decay_iters=None,
    )
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    restored_optimizer.load_state_dict(optimizer.state_dict())
    assert restored.state_dict() == original.state_dict()
    assert _run(restored, restored_optimizer, 10) == _run(original, optimizer, 10)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"decay_style": "step"}, r"--lr-decay-style 'step' is not a decay style"),
        ({"lr": -1.0}, r"--lr \(-1.0\) and --min-lr \(0.0\) must be >= 0"),
        ({"min_lr": 2.0}, r"--min-lr \(2.0\) must not exceed --lr \(1.0\)"),
        ({"warmup_iters": -1}, r"--lr-warmup-iters must be >= 0, got -1"),
        (
            {"decay_iters": None},
            r"linear needs --lr-decay-iters greater than --lr-warmup-iters \(2\)",
        ),
        ({"decay_iters": 2}, r"greater than --lr-warmup-iters \(2\), got 2"),
        (
            {"wsd_decay_iters": 3},
            r"--lr-wsd-decay-iters \(3\) only applies to --lr-decay-style wsd",
        ),
        ({"decay_style": "wsd"}, r"wsd needs --lr-wsd-decay-iters in \[1, 8\]"),
        ({"decay_style": "wsd", "wsd_decay_iters": 9}, r"in \[1, 8\] .* got 9"),
    ],
)
def test_invalid_schedules_are_rejected_naming_the_flag(kwargs, message):
    settings_ = {
        "decay_style": "linear",
        "lr": 1.0,
        "min_lr": 0.0,
        "warmup_iters": 2,
        "decay_iters": 10,
    } | kwargs
    with pytest.raises(ValueError, match=message):
        get_lr_scheduler(_optimizer(), **settings_)


def test_loading_a_different_schedule_follows_the_checkpoint_and_warns(caplog):
    saved = get_lr_scheduler(
        _optimizer(), decay_style="linear", lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=10
    )
    optimizer = _optimizer()
    configured = get_lr_scheduler(
        optimizer, decay_style="constant", lr=2.0, min_lr=0.0, warmup_iters=0, decay_iters=None
    )
    configured.load_state_dict(saved.state_dict())
    assert configured.state_dict() == saved.state_dict()
    assert "--lr-decay-style constant -> linear" in caplog.text
    assert "--lr 2.0 -> 1.0" in caplog.text
