"""The train-actor contract: abstract methods, argument checks and process-group set-up."""

from __future__ import annotations

import ipaddress
import multiprocessing
import os
import socket
import sys
from pathlib import Path

import pytest

from miles.train_backend import TrainRayActor


class _EchoActor(TrainRayActor):
    """A backend whose engine is never built: these tests exercise the constructor and the
    process-group set-up, which come before any engine."""

    def build_engine(self, spec, backend, *, device, with_ref):
        raise NotImplementedError("not part of these tests")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening_addresses() -> set[str]:
    """The local addresses this process listens on (Linux: its socket inodes in /proc/net/tcp*);
    an empty set elsewhere."""
    fds = Path("/proc/self/fd")
    if not fds.is_dir():
        return set()
    inodes = set()
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("tcp", "tcp6"):
        path = Path("/proc/self/net") / table
        for line in path.read_text().splitlines()[1:] if path.is_file() else []:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                found.add(_decode_address(local.split(":")[0]))
    return found


def _decode_address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    # /proc prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _join_and_all_reduce(rank: int, world_size: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MILES_DEVICE"] = "cpu"
    try:
        actor = _EchoActor(rank, world_size, "127.0.0.1", port)
        actor.setup_distributed(timeout_s=60)
        start = actor.data_parallel_rank() - rank  # before init: every rank its own replica
        actor.setup_distributed(timeout_s=60)  # a second call keeps the group
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        env = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
        env["listening"] = sorted(_listening_addresses())
        queue.put((rank, start, value.item(), dist.get_backend(), env))
        dist.destroy_process_group()
    except BaseException as err:
        queue.put((rank, "error", repr(err), None, None))


def test_a_backend_without_an_engine_cannot_be_instantiated():
    class Partial(TrainRayActor):
        pass

    with pytest.raises(TypeError, match="abstract"):
        Partial(0, 1, "127.0.0.1", 29500)


def test_a_backend_implements_only_the_engine_builder():
    assert TrainRayActor.__abstractmethods__ == {"build_engine"}


def test_calls_before_init_say_to_call_init():
    actor = _EchoActor(0, 1, "127.0.0.1", 29500)
    with pytest.raises(RuntimeError, match=r"call init\(\) first"):
        actor.train(0, {"tokens": []})


@pytest.mark.parametrize(
    ("rank", "world_size", "addr", "port", "message"),
    [
        (2, 2, "127.0.0.1", 29500, "rank 2 of world size 2"),
        (-1, 2, "127.0.0.1", 29500, "rank -1"),
        (0, 0, "127.0.0.1", 29500, "world_size >= 1"),
        (0, 1, "127.0.0.1", 0, "master_port 0"),
        (0, 1, "127.0.0.1", 70000, "master_port 70000"),
        (0, 1, "", 29500, "master_addr is empty"),
    ],
)
def test_constructor_rejects_an_impossible_placement(rank, world_size, addr, port, message):
    with pytest.raises(ValueError, match=message):
        _EchoActor(rank, world_size, addr, port)


def test_local_rank_defaults_to_the_first_device(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert _EchoActor(0, 1, "127.0.0.1", 29500).local_rank == 0
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert _EchoActor(0, 1, "127.0.0.1", 29500).local_rank == 3


def test_setup_distributed_joins_every_rank_with_rank_zero_as_master():
    ctx = multiprocessing.get_context("spawn" if sys.platform == "darwin" else "forkserver")
    port, world_size = _free_port(), 2
    queue = ctx.Queue()
    processes = [
        ctx.Process(target=_join_and_all_reduce, args=(rank, world_size, port, queue))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    try:
        results = sorted(queue.get(timeout=90) for _ in processes)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    for rank, start, total, backend, env in results:
        assert start == 0, f"rank {rank} failed: {total}"
        assert total == 3.0  # 1 + 2: both ranks are in one group
        assert backend == "gloo"
        # A loopback master: the store and gloo's pairs listen on loopback only, never on the
        # machine's network addresses (torch's own store would listen on all of them).
        listening = env.pop("listening")
        assert all(ipaddress.ip_address(a).is_loopback for a in listening), listening
        assert listening or not Path("/proc/self/fd").is_dir(), "rank 0 listens for the store"
        assert env == {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
        }  # fmt: skip


def _join_twice_with_another_rank(port: int, queue) -> None:
    os.environ["MILES_DEVICE"] = "cpu"
    import torch.distributed as dist

    try:
        _EchoActor(0, 1, "127.0.0.1", port).setup_distributed(timeout_s=30)
        try:
            _EchoActor(0, 2, "127.0.0.1", port).setup_distributed(timeout_s=30)
            queue.put("no error")
        except RuntimeError as err:
            queue.put(str(err))
        dist.destroy_process_group()
    except BaseException as err:
        queue.put(repr(err))


def test_setup_distributed_refuses_a_group_of_another_size():
    ctx = multiprocessing.get_context("spawn" if sys.platform == "darwin" else "forkserver")
    queue = ctx.Queue()
    process = ctx.Process(target=_join_twice_with_another_rank, args=(_free_port(), queue))
    process.start()
    try:
        message = queue.get(timeout=60)
    finally:
        process.join(timeout=10)
    assert "already joined a process group as rank 0 of 1" in message
    assert "rank 0 of 2" in message


def test_core_train_actor_imports_neither_ray_nor_a_backend():
    import subprocess

    code = (
        "import sys, miles.train_backend.train_actor; "
        "bad = [m for m in sys.modules if m == 'ray' or m.startswith(('ray.', "
        "'miles.backends.fsdp_utils', 'miles.backends.megatron_utils'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
