"""The update flow shared by the backends: which rank feeds which engine, and that a failed send
on any rank fails the update on every rank (no rank left waiting in a collective)."""

from __future__ import annotations

import socket

import pytest
import torch

from miles.backends.sglang_utils.client import SyncEngineClient
from miles.backends.sglang_utils.weight_sync import UpdateWeightFromTensor, engine_urls_for_rank
from tests.support.distributed import run_distributed

URLS = ["http://e0", "http://e1"]


@pytest.mark.parametrize(
    ("colocate", "world_size", "expected"),
    [
        (True, 2, [["http://e0"], ["http://e1"]]),  # one engine per rank: each on its device
        (True, 4, [URLS, [], [], []]),  # engines spanning devices: rank 0 feeds all
        (False, 2, [URLS, []]),  # a broadcast group from rank 0 reaches every engine
    ],
)
def test_each_rank_feeds_the_engines_it_can_reach(colocate, world_size, expected):
    got = [
        engine_urls_for_rank(URLS, rank=r, world_size=world_size, colocate=colocate)
        for r in range(world_size)
    ]
    assert got == expected


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens once closed


def _update_through_unreachable_engines(rank: int) -> str:
    gathered = []

    def named_tensors():
        for i in range(3):
            value = torch.tensor([float(i)])
            torch.distributed.all_reduce(value)  # a collective per tensor, like a shard gather
            gathered.append(i)
            yield f"w{i}", value

    # Colocated one engine per rank: each rank sends to its own, and here neither answers.
    clients = [SyncEngineClient(_closed_port_url(), max_retries=0)]
    updater = UpdateWeightFromTensor(named_tensors, clients, buffer_size=1 << 20,
                                     dtype=torch.float32)  # fmt: skip
    try:
        updater.update("1")
    except Exception as err:
        return f"{type(err).__name__} after draining {gathered}"
    finally:
        updater.shutdown()
    return "no error"


def test_every_sending_rank_reports_its_failure_after_joining_every_gather():
    results = run_distributed(_update_through_unreachable_engines, 2, timeout_s=120)
    assert all(r.endswith("after draining [0, 1, 2]") for r in results), results
