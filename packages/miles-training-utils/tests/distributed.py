"""Run a test function on N CPU processes joined by a real gloo process group.

Multi-process tests use real process groups (STYLE: "Our habits" 8), never mocked collectives.
"""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

# After the first rank fails, how long the others get to report before they are killed: a peer
# stuck in a collective with the dead rank usually errors out within this time, and its traceback
# is often the more telling one.
_GRACE_AFTER_FAILURE_S = 3.0
_PRELOAD = ("torch", "torch.distributed", "pytest", "hypothesis")


class DistributedWorkerError(AssertionError):
    """One or more ranks raised (or died); the message holds every failed rank's traceback.

    An AssertionError, so a failed `assert` inside a worker reads as a test failure in pytest.
    """


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_distributed(
    fn: Callable[..., T], world_size: int, *args: Any, timeout_s: float = 60.0
) -> list[T]:
    """Call `fn(rank, *args)` in `world_size` fresh processes joined by one gloo process group.

    Each process joins the default group (`dist.init_process_group("gloo", ...)` over
    `tcp://127.0.0.1:<free port>`), so `fn` can use `dist.get_rank()`, `dist.group.WORLD` or
    `dist.new_group(...)` directly; the group is destroyed when `fn` returns or raises. Workers
    default `$MILES_DEVICE` to `cpu` and use one intra-op thread each.

    Returns the values `fn` returned, in rank order (they must be picklable). If any rank raises
    or dies, raises `DistributedWorkerError` carrying the traceback of every rank that failed.
    Ranks still running `timeout_s` seconds after the start are killed and reported as hung.

    Workers are forked from a clean "forkserver" interpreter that has imported only torch, pytest
    and hypothesis (never from the pytest process itself), so after the first call a run starts
    in well under a second; where forkserver is unavailable they are spawned. Either way `fn` and
    `args` travel by pickle, so `fn` must be a module-level function of an importable module (a
    test module is fine; a lambda or a nested function is not). Example::

        from .distributed import run_distributed

        def _all_reduce_sum(rank: int, base: float) -> float:
            t = torch.tensor([base + rank])
            dist.all_reduce(t)
            return t.item()

        def test_all_reduce_sums_over_ranks():
            assert run_distributed(_all_reduce_sum, 2, 1.0) == [3.0, 3.0]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    processes, readers = [], []
    for rank in range(world_size):
        reader, writer = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, init_method, timeout_s, args, writer),
            name=f"miles-test-rank{rank}",
            daemon=True,
        )
        process.start()
        # Only the child holds the write end now, so a child that dies without reporting
        # shows up as EOF on its reader instead of a hang.
        writer.close()
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
            f"--- rank {rank} of {world_size} ---\n{msg}" for rank, msg in sorted(failures.items())
        )
        raise DistributedWorkerError(
            f"{len(failures)} of {world_size} ranks failed running {fn.__qualname__}:\n{details}"
        )
    return [reports[rank][1] for rank in range(world_size)]


def _context() -> multiprocessing.context.BaseContext:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # The fork server is a fresh interpreter (like spawn) that imports these once; each worker
    # is then forked from it, so a test pays for importing torch once per session, not per rank.
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _collect(readers: list, timeout_s: float) -> dict[int, tuple[bool, Any]]:
    """(ok, value-or-traceback) per rank; ranks that never report are marked as hung."""
    reports: dict[int, tuple[bool, Any]] = {}
    pending = dict(enumerate(readers))
    deadline = time.monotonic() + timeout_s
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready = multiprocessing.connection.wait(list(pending.values()), timeout=remaining)
        for rank, reader in list(pending.items()):
            if reader not in ready:
                continue
            try:
                reports[rank] = reader.recv()
            except EOFError:
                reports[rank] = (False, "the process exited without reporting (killed or crashed)")
            del pending[rank]
        if any(not ok for ok, _ in reports.values()):
            deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
    for rank in pending:
        reports[rank] = (
            False,
            f"no result after {timeout_s:.0f} s; killed (hung in a collective?)",
        )
    return reports


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_method: str,
    timeout_s: float,
    args: tuple,
    writer: multiprocessing.connection.Connection,
) -> None:
    # Two ranks on a small CI machine: one intra-op thread each avoids oversubscribing the cores.
    torch.set_num_threads(1)
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
    except BaseException:
        report = (False, traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    try:
        writer.send(report)
    except Exception:  # the return value did not pickle: report that instead
        writer.send(
            (False, f"rank {rank} returned an unpicklable value:\n{traceback.format_exc()}")
        )
    finally:
        writer.close()
