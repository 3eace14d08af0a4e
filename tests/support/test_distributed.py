"""The gloo test harness itself: failures and hangs are reported with each rank's story, a
worker may start processes of its own (Megatron's checkpoint writer does), and the fork server
keeps every module any caller asked it to preload."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.support.distributed import DistributedWorkerError, run_distributed


def _rank_and_size(rank: int) -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _fails_on_rank_1(rank: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    return rank


def _hangs(rank: int) -> None:
    time.sleep(600)


def _uses_a_manager(rank: int) -> list[int]:
    with multiprocessing.get_context("spawn").Manager() as manager:
        shared = manager.list()
        shared.append(rank)
        return list(shared)


def test_the_fork_server_restarts_only_for_a_module_it_lacks_and_keeps_the_union():
    # In a fresh interpreter (fork_server_probe.py): here it would restart the suite's own server.
    probe = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("fork_server_probe.py"))],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-4000:]
    asked = json.loads(probe.stdout.splitlines()[-1])
    (first_server, first), again, (second_server, second), last = asked
    assert first == ["tabnanny"]
    assert again == [first_server, ["tabnanny"]]  # a subset: the same server, still holding it
    assert second_server != first_server  # restarted once for the module it lacked
    assert second == ["tabnanny", "pyclbr"]  # ... with the union, not only the newest list
    assert last == [second_server, ["tabnanny", "pyclbr"]]


def test_each_rank_joins_one_group_and_results_come_back_by_rank():
    assert run_distributed(_rank_and_size, 2) == [(0, 2), (1, 2)]


def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(DistributedWorkerError, match=r"(?s)--- rank 1 of 2 ---.*rank 1 refuses"):
        run_distributed(_fails_on_rank_1, 2, timeout_s=60)


def test_a_hung_rank_is_killed_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedWorkerError, match="no result after 2"):
        run_distributed(_hangs, 1, timeout_s=2)
    assert time.monotonic() - start < 30


def test_a_worker_may_start_processes_of_its_own():
    assert run_distributed(_uses_a_manager, 1, timeout_s=60) == [[0]]
