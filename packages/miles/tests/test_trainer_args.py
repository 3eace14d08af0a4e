"""TrainerArgs: the checks every backend's settings inherit, and how a backend extends them."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Literal

import pytest

from miles.config.options import dataclass_options
from miles.config.trainer_args import TrainerArgs


@dataclass(kw_only=True)
class ToyBackendArgs(TrainerArgs):
    """A backend's settings group: its own choice field and minimum on top of the shared ones."""

    kernel: Literal["fast", "exact"] = "exact"
    """Which kernel the toy backend runs."""
    shards: int = 1
    """How many shards the toy backend splits the model into."""

    MINIMUMS: typing.ClassVar[dict[str, float]] = {**TrainerArgs.MINIMUMS, "shards": 1}


def test_a_backend_inherits_the_shared_flags_and_adds_its_own():
    names = [option.name for option in dataclass_options(ToyBackendArgs, "backend")]
    shared = [f.name for f in dataclasses.fields(TrainerArgs)]
    assert {"lr", "lora_rank", "seed"} <= set(shared)
    assert names[: len(shared)] == shared and names[len(shared) :] == ["kernel", "shards"]
    assert ToyBackendArgs(lr=1e-5, shards=4).shards == 4


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"kernel": "quick"}, r"--kernel 'quick' is not a valid choice; use one of fast, exact"),
        ({"shards": 0}, r"--shards must be >= 1, got 0"),
        ({"lr": -1.0}, r"--lr must be >= 0.0, got -1.0"),
        ({"adam_beta2": 1.0}, r"--adam-beta2 must be in \[0, 1\), got 1.0"),
        ({"min_lr": 1e-6, "lr": 1e-7, "lr_decay_style": "cosine"}, r"--min-lr .* must not exceed"),
        ({"lr_decay_style": "wsd"}, r"wsd needs --lr-wsd-decay-iters"),
        ({"lr_decay_iters": 10}, r"--lr-decay-iters \(10\) has no effect with --lr-decay-style constant"),
        ({"use_dynamic_batch_size": True}, r"--use-dynamic-batch-size needs --max-tokens-per-gpu"),
    ],
)  # fmt: skip
def test_shared_and_backend_settings_are_checked_where_they_are_built(values, message):
    with pytest.raises(ValueError, match=message):
        ToyBackendArgs(**values)


def test_shared_flags_keep_their_docstrings_in_a_subclass():
    docs = {option.name: option.doc for option in dataclass_options(ToyBackendArgs, "backend")}
    assert docs["lr"] == "Peak learning rate (after warmup)." and docs["shards"]
