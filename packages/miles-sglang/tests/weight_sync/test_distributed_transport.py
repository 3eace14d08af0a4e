"""Disaggregated transport: a broadcast group of real processes, beside any default group."""

from __future__ import annotations

import datetime

import psutil
import pytest
import torch
import torch.distributed as dist

from miles.backends.sglang_utils.weight_sync import (
    broadcast_tensors,
    create_weight_update_group,
    receive_tensors,
)

from .multiprocess import free_port, run_processes


def _bucket() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(8, 4, generator=gen).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(4, generator=gen)),
        ("model.position_ids", torch.arange(6).reshape(2, 3)),
        ("model.mask", torch.tensor([True, False])),
        ("model.empty", torch.empty(0, 3)),
    ]


def _as_lists(named) -> list:
    return [(n, str(t.dtype), list(t.shape), t.double().flatten().tolist()) for n, t in named]


def _join_and_transfer(rank: int, port: int, world_size: int) -> list | None:
    group = create_weight_update_group(
        master_address="127.0.0.1", master_port=port, rank=rank, world_size=world_size,
        group_name="miles-test", backend="gloo", timeout_s=30,
    )  # fmt: skip
    try:
        if rank == 0:
            broadcast_tensors(group, _bucket())
            return None
        bucket = _bucket()
        names = [n for n, _ in bucket]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        return _as_lists(receive_tensors(group, names, dtypes, shapes, "cpu"))
    finally:
        group.destroy()


def test_every_engine_receives_each_tensor_in_order_with_its_dtype():
    results = run_processes(_join_and_transfer, 3, free_port(), 3)
    expected = _as_lists(_bucket())
    assert results == [None, expected, expected]


def _beside_default_group(rank: int, default_port: int, port: int) -> tuple[float, list]:
    # Engine and trainer may already own a default group; ours must not touch or need it.
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{default_port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    try:
        group = create_weight_update_group(
            master_address="127.0.0.1", master_port=port, rank=rank, world_size=2,
            group_name="beside-default", backend="gloo", timeout_s=30,
        )  # fmt: skip
        tensor = torch.full((3,), 7.0) if rank == 0 else torch.zeros(3)
        group.broadcast(tensor, src=0)
        group.destroy()
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)  # the default group still works after ours is gone
        return total.item(), tensor.tolist()
    finally:
        dist.destroy_process_group()


def test_group_works_beside_an_existing_default_group():
    results = run_processes(_beside_default_group, 2, free_port(), free_port())
    assert results == [(3.0, [7.0] * 3), (3.0, [7.0] * 3)]


def _sglang_style_join(rank: int, port: int) -> list:
    """Rank 0 is ours; rank 1 joins as SGLang's `init_custom_process_group` does (its code path)."""
    if rank == 0:
        group = create_weight_update_group(
            master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
            group_name="sglang-compat", backend="gloo", timeout_s=30,
        )  # fmt: skip
        broadcast_tensors(group, _bucket())
        group.destroy()
        return _as_lists(_bucket())
    from torch.distributed.distributed_c10d import (
        PrefixStore,
        _new_process_group_helper,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=30)
    store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore("sglang-compat", store)
    pg, _ = _new_process_group_helper(
        2, 1, [], "gloo", store, group_name="sglang-compat", timeout=timeout
    )
    received = [(n, torch.empty_like(t)) for n, t in _bucket()]
    for _, tensor in received:
        pg.broadcast([tensor]).wait()
    return _as_lists(received)


def test_an_engine_joining_the_way_sglang_does_meets_our_rank_0():
    sent, received = run_processes(_sglang_style_join, 2, free_port())
    assert received == sent


def test_single_rank_group_forms_alone_and_refuses_use_after_destroy():
    group = create_weight_update_group(
        master_address="127.0.0.1", master_port=free_port(), rank=0, world_size=1,
        group_name="alone", backend="gloo", timeout_s=10,
    )  # fmt: skip
    with pytest.raises(ValueError, match="contiguous"):
        group.broadcast(torch.zeros(3, 2).t())
    group.destroy()
    group.destroy()  # idempotent
    with pytest.raises(RuntimeError, match="was destroyed"):
        group.broadcast(torch.zeros(2))


def _listening_addresses(port: int) -> list[str]:
    return sorted(
        c.laddr.ip
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    )


def test_rank_0_serves_the_rendezvous_on_the_given_address_only():
    # TCPStore's own master would listen on every interface, opening a loopback run's rendezvous.
    port = free_port()
    group = create_weight_update_group(
        master_address="127.0.0.1", master_port=port, rank=0, world_size=1,
        group_name="loopback-only", backend="gloo", timeout_s=10,
    )  # fmt: skip
    try:
        assert _listening_addresses(port) == ["127.0.0.1"]
        with pytest.raises(RuntimeError, match=rf"cannot listen on 127.0.0.1:{port} .*free port"):
            create_weight_update_group(
                master_address="127.0.0.1", master_port=port, rank=0, world_size=1,
                group_name="same-port", backend="gloo", timeout_s=10,
            )  # fmt: skip
    finally:
        group.destroy()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 2, "world_size": 2}, r"rank \(2\) must be in \[0, world_size=2\)"),
        ({"backend": "mpi"}, "'mpi' is not supported; use 'gloo' or 'nccl'"),
        ({"group_name": ""}, "non-empty"),
    ],
)
def test_bad_group_arguments_are_rejected_before_any_connection(kwargs, match):
    args = {"master_address": "127.0.0.1", "master_port": 1, "rank": 0, "world_size": 2,
            "group_name": "g", "backend": "gloo", **kwargs}  # fmt: skip
    with pytest.raises(ValueError, match=match):
        create_weight_update_group(**args)


def test_receive_rejects_lists_of_different_lengths():
    with pytest.raises(ValueError, match=r"names \(2\), dtypes \(1\) and shapes \(2\)"):
        receive_tensors(None, ["a", "b"], ["float32"], [[1], [2]], "cpu")


def _nccl_transfer(rank: int, port: int) -> list:
    torch.cuda.set_device(rank)
    group = create_weight_update_group(
        master_address="127.0.0.1", master_port=port, rank=rank, world_size=2,
        group_name="nccl-test", backend="nccl", timeout_s=60,
    )  # fmt: skip
    try:
        bucket = [(n, t.cuda()) for n, t in _bucket() if t.numel()]
        if rank == 0:
            broadcast_tensors(group, bucket)
            return _as_lists(bucket)
        names, shapes = [n for n, _ in bucket], [list(t.shape) for _, t in bucket]
        dtypes = [t.dtype for _, t in bucket]
        return _as_lists(receive_tensors(group, names, dtypes, shapes, torch.device("cuda", 1)))
    finally:
        group.destroy()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two CUDA devices")
def test_nccl_group_broadcasts_between_two_gpus():
    sent, received = run_processes(_nccl_transfer, 2, free_port())
    assert sent == received
