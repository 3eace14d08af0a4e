"""Run test functions in fresh processes, for transports that need a real peer process.

Unlike training-utils' `run_distributed`, no default process group is formed: a weight-update
group must work on its own (and next to one), so each test builds exactly the groups it needs.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from tests.support.distributed import forkserver_context

_PRELOAD = ("torch", "torch.distributed", "miles.backends.sglang_utils.weight_sync")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def context() -> multiprocessing.context.BaseContext:
    """forkserver (a clean interpreter that imported torch once, shared with training-utils'
    `run_distributed`), else spawn; never fork pytest."""
    return forkserver_context(_PRELOAD)


def run_processes(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float = 60.0) -> list:
    """Call `fn(rank, *args)` in `nprocs` fresh processes; return their results in rank order.

    `fn` must be a module-level function (it travels by pickle). Raises AssertionError with the
    traceback of every process that raised, died or did not finish within `timeout_s`.
    """
    ctx = context()
    processes, readers = [], []
    for rank in range(nprocs):
        reader, writer = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_worker, args=(fn, rank, args, writer), daemon=True)
        process.start()
        writer.close()  # the child holds the only write end: its death reads as EOF, not a hang
        processes.append(process)
        readers.append(reader)
    reports = {}
    deadline = time.monotonic() + timeout_s
    try:
        for rank, reader in enumerate(readers):
            if not reader.poll(max(0.0, deadline - time.monotonic())):
                reports[rank] = (False, f"no result after {timeout_s:.0f} s (hung?)")
                continue
            try:
                reports[rank] = reader.recv()
            except EOFError:
                reports[rank] = (False, "the process died without reporting")
    finally:
        for process in processes:
            process.join(timeout=2.0)
            if process.is_alive():
                process.kill()
                process.join()
    failed = {rank: msg for rank, (ok, msg) in reports.items() if not ok}
    if failed:
        details = "\n".join(f"--- process {r} ---\n{m}" for r, m in sorted(failed.items()))
        raise AssertionError(f"{len(failed)} of {nprocs} processes failed:\n{details}")
    return [reports[rank][1] for rank in range(nprocs)]


def _worker(fn: Callable[..., Any], rank: int, args: tuple, writer: Any) -> None:
    import torch

    torch.set_num_threads(1)  # several processes on a small CI machine: do not oversubscribe
    try:
        report = (True, fn(rank, *args))
    except BaseException:
        report = (False, traceback.format_exc())
    writer.send(report)
    writer.close()
