"""Run a function on N CPU processes joined by a real gloo process group, for tests of
distributed code in every miles package (real process groups, never mocked collectives).

Workers are forked from a "forkserver" that imports the heavy modules once, so a multi-rank test
costs its imports once per session instead of once per rank and test. Callers name the modules
their workers need (`preload=`); the server holds the union of every list asked for so far and is
restarted only when a call names a module it lacks. Example::

    from tests.support.distributed import run_distributed

    def _all_reduce_sum(rank: int, base: float) -> float:
        t = torch.tensor([base + rank])
        dist.all_reduce(t)
        return t.item()

    def test_all_reduce_sums_over_ranks():
        assert run_distributed(_all_reduce_sum, 2, 1.0) == [3.0, 3.0]
"""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

# What the fork server imports once, so workers forked from it start in well under a second.
# Names that are not installed are skipped by the fork server.
DEFAULT_PRELOAD = ("torch", "torch.distributed", "pytest", "hypothesis")
# After the first rank fails, how long the others get to report before they are killed.
_GRACE_AFTER_FAILURE_S = 3.0


class DistributedWorkerError(AssertionError):
    """One or more ranks raised or died; the message holds every failed rank's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_distributed(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    preload: tuple[str, ...] = DEFAULT_PRELOAD,
) -> list[T]:
    """Call `fn(rank, *args)` on `world_size` fresh processes in one gloo group; results by rank.

    `fn` must be a module-level function (it travels by pickle), and so must its results.
    Workers run with $MILES_DEVICE=cpu and one intra-op thread. If any rank raises, dies or is
    still running after `timeout_s`, raises DistributedWorkerError with every failed traceback.
    `preload` names the modules the fork server imports once (see `forkserver_context`).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = forkserver_context(preload)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    processes, readers = [], []
    for rank in range(world_size):
        reader, writer = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, init_method, timeout_s, args, writer),
            name=f"miles-test-rank{rank}",
            # Not daemonic: code under test may start processes of its own (Megatron's checkpoint
            # writer does). Workers never outlive this call: the `finally` below kills them.
            daemon=False,
        )
        process.start()
        writer.close()  # only the child holds the write end: a dead child reads as EOF
        processes.append(process)
        readers.append(reader)
    try:
        reports = _collect(readers, timeout_s)
    finally:
        for process in processes:
            process.join(timeout=1.0)
            if process.is_alive():
                process.kill()
                process.join()
    failures = {rank: msg for rank, (ok, msg) in reports.items() if not ok}
    if failures:
        details = "\n".join(
            f"--- rank {r} of {world_size} ---\n{m}" for r, m in sorted(failures.items())
        )
        raise DistributedWorkerError(
            f"{len(failures)} of {world_size} ranks failed running {fn.__qualname__}:\n{details}"
        )
    return [reports[rank][1] for rank in range(world_size)]


def forkserver_context(preload: tuple[str, ...]) -> multiprocessing.context.BaseContext:
    """A multiprocessing context whose processes fork from a server that has imported `preload`.

    multiprocessing keeps one fork server per process and fixes its preload list when it starts,
    so a second caller with other modules would otherwise make every worker import them again
    (megatron-core alone is ~11 s per process here). The server instead holds the union of every
    list asked for: a call naming a module it lacks restarts it once with the union, and calls
    naming a subset reuse it. Names that are not installed are skipped by the server. Falls back
    to "spawn" where forkserver does not exist.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    wanted = _served_preload | set(preload)
    if wanted != _served_preload:
        # A server started with a smaller list is stopped; the next Process.start() starts the
        # new one. Workers already forked from the old server are unaffected.
        multiprocessing.forkserver._forkserver._stop()
        _served_preload.update(wanted)
    ctx.set_forkserver_preload(sorted(_served_preload))
    return ctx


# The modules the running (or next) fork server of this process imports.
_served_preload: set[str] = set()


def _collect(readers: list, timeout_s: float) -> dict[int, tuple[bool, Any]]:
    reports: dict[int, tuple[bool, Any]] = {}
    pending = dict(enumerate(readers))
    deadline = time.monotonic() + timeout_s
    while pending and (remaining := deadline - time.monotonic()) > 0:
        ready = multiprocessing.connection.wait(list(pending.values()), timeout=remaining)
        for rank, reader in list(pending.items()):
            if reader in ready:
                try:
                    reports[rank] = pickle.loads(reader.recv_bytes())
                except EOFError:
                    reports[rank] = (False, "the process exited without reporting (crashed?)")
                del pending[rank]
        if any(not ok for ok, _ in reports.values()):
            deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
    for rank in pending:
        reports[rank] = (
            False,
            f"no result after {timeout_s:.0f} s; killed (hung in a collective?)",
        )
    return reports


def _worker(fn, rank, world_size, init_method, timeout_s, args, writer) -> None:
    torch.set_num_threads(1)  # several ranks share a small CI machine
    os.environ.setdefault("MILES_DEVICE", "cpu")
    try:
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        report = (True, fn(rank, *args))
        # Rank 0 hosts the rendezvous store: a rank that exits early would break peers that are
        # still creating gloo groups through it (group creation does not wait for non-members).
        dist.barrier()
    except BaseException:
        report = (False, traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Plain pickle, not multiprocessing's: that one passes tensors as shared-memory handles,
    # which die with this process before the parent opens them.
    try:
        payload = pickle.dumps(report)
    except Exception:  # the return value did not pickle: report that instead
        payload = pickle.dumps(
            (False, f"rank {rank} returned an unpicklable value:\n{traceback.format_exc()}")
        )
    try:
        writer.send_bytes(payload)
    finally:
        writer.close()
