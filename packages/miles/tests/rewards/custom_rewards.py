"""Reward functions the hub tests load through --custom-rm-path (this directory is put on sys.path)."""

from __future__ import annotations

import asyncio
import threading
import time

from miles.backends.training_utils.batching.sample import Sample

NOT_A_FUNCTION = 42
CALLS: list[list[str]] = []
"""The groups `group_mean_rank` was called with, as lists of responses."""
IN_FLIGHT = {"now": 0, "peak": 0}


def flaky(sample: Sample) -> float:
    """1.0, except for samples labelled `boom`, where it raises."""
    if sample.label == "boom":
        raise RuntimeError(f"cannot score {sample.response!r}")
    return 1.0


async def async_length(sample: Sample) -> float:
    """Length of the response, computed in a coroutine."""
    await asyncio.sleep(0)
    return float(len(sample.response))


def as_dict(sample: Sample) -> dict[str, float]:
    """A dict with the reward under `score` and a distractor under `reward`."""
    return {"score": 0.25, "reward": -1.0}


def bad_values(sample: Sample) -> object:
    """What the label asks for: a string, NaN, None or a bool."""
    return {"str": "1.0", "nan": float("nan"), "none": None, "bool": True}[sample.label]


def magnitude(sample: Sample) -> float:
    """The label as a number: rewards of any magnitude ("1e308"), or "nan"."""
    return float(sample.label)


def raises_timeout(sample: Sample) -> float:
    raise TimeoutError("upstream judge timed out")


async def sleeps_forever(sample: Sample) -> float:
    await asyncio.sleep(3600)
    return 1.0


def sleeps_a_while(sample: Sample) -> float:
    """A slow synchronous reward: short, so the abandoned thread ends soon after the test."""
    time.sleep(1.0)
    return 1.0


# Four sync calls that only finish if they all run at once: proof that sync rewards use threads.
_barrier = threading.Barrier(4, timeout=10)


def needs_three_peers(sample: Sample) -> float:
    _barrier.wait()
    return 1.0


def group_mean_rank(samples: list[Sample]) -> list[float]:
    """Per group: the position of each sample in its group over the group size; records calls."""
    CALLS.append([s.response for s in samples])
    return [i / len(samples) for i in range(len(samples))]


def group_wrong_length(samples: list[Sample]) -> list[float]:
    return [1.0] * (len(samples) + 1)


def group_mixed(samples: list[Sample]) -> list[object]:
    """A good reward for the first sample, a non-number for the rest."""
    return [1.0] + ["oops"] * (len(samples) - 1)


async def count_in_flight(sample: Sample) -> float:
    """Records the most calls running at once."""
    IN_FLIGHT["now"] += 1
    IN_FLIGHT["peak"] = max(IN_FLIGHT["peak"], IN_FLIGHT["now"])
    await asyncio.sleep(0.01)
    IN_FLIGHT["now"] -= 1
    return 1.0
