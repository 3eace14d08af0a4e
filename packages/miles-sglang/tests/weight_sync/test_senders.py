"""Senders: every engine ends with the trainer's weights, the cache is flushed once, errors carry why."""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time

import pytest
import torch

from miles.backends.sglang_utils.weight_sync import (
    DistributedWeightSender,
    TensorWeightSender,
    WeightSyncError,
    create_weight_update_group,
    deserialize_flattened_bucket,
    deserialize_named_tensors,
    load_named_tensors,
    receive_flattened,
    receive_tensors,
    unflatten_bucket,
)

from .multiprocess import context, free_port

OK = {"success": True, "message": ""}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.register_buffer("step", torch.tensor([seed, seed + 1]))  # an integer buffer: never cast
    return model


def _expected(trainer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What an fp32 engine holds after a bf16 update: every float went through bfloat16."""
    return {
        k: v.to(torch.bfloat16).float() if v.is_floating_point() else v
        for k, v in trainer.state_dict().items()
    }


def _assert_state(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(state[name], value), name


def _segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")}


class LoadingEngine:
    """A stand-in engine that reads each payload as the reference engine does and loads it."""

    def __init__(self, model: torch.nn.Module, refuse: str | None = None, raises: bool = False):
        self.model, self.refuse, self.raises = model, refuse, raises
        self.calls: list[dict] = []

    def update_weights_from_tensor(
        self, serialized_named_tensors, load_format, flush_cache, weight_version
    ):
        self.calls.append({"flush_cache": flush_cache, "weight_version": weight_version})
        if self.raises:
            raise ConnectionError("connection refused")
        if self.refuse:
            return {"success": False, "message": self.refuse}
        (payload,) = serialized_named_tensors
        if load_format == "flattened_bucket":
            named = unflatten_bucket(deserialize_flattened_bucket(payload))
        else:
            named = deserialize_named_tensors(payload)
        load_named_tensors(self.model, named)
        return OK


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_tensor_sender_updates_every_engine_and_flushes_with_the_last_bucket_only(load_format):
    baseline = _segments()
    trainer, engines = _model(1), [LoadingEngine(_model(0)), LoadingEngine(_model(0))]
    sender = TensorWeightSender(
        engines, max_bytes=200, dtype=torch.bfloat16, load_format=load_format
    )
    count = sender.send(trainer.state_dict().items(), weight_version="7")
    assert count > 2
    for engine in engines:
        _assert_state(engine.model.state_dict(), _expected(trainer))
        assert [c["flush_cache"] for c in engine.calls] == [False] * (count - 1) + [True]
        assert {c["weight_version"] for c in engine.calls} == {"7"}
    # The staging buffers are the only segments left between syncs (at most two: one grown for
    # a tensor larger than a bucket is freed after the sync), and a next send works on them.
    assert 1 <= len(_segments() - baseline) <= 2
    trainer = _model(2)
    assert sender.send(trainer.state_dict().items(), weight_version="8") == count
    for engine in engines:
        _assert_state(engine.model.state_dict(), _expected(trainer))
    assert 1 <= len(_segments() - baseline) <= 2
    sender.close()
    assert _segments() == baseline, "shared-memory segments outlived the sender"


def test_tensor_sender_raises_with_every_engines_message():
    engines = [
        LoadingEngine(_model(0)),
        LoadingEngine(_model(0), refuse="weights are released"),
        LoadingEngine(_model(0), raises=True),
    ]
    sender = TensorWeightSender(engines, max_bytes=1 << 20, dtype=None)
    with pytest.raises(WeightSyncError, match="2 of 3 engines failed") as info:
        sender.send(_model(1).state_dict().items(), weight_version="1")
    assert info.value.engine_messages == {
        1: "weights are released",
        2: "ConnectionError: connection refused",
    }


def test_tensor_sender_rejects_bad_settings_and_an_empty_update():
    with pytest.raises(ValueError, match="--update-weight-buffer-size"):
        TensorWeightSender([LoadingEngine(_model(0))], max_bytes=0, dtype=None)
    with pytest.raises(ValueError, match="load_format 'safetensors'"):
        TensorWeightSender(
            [LoadingEngine(_model(0))], max_bytes=1, dtype=None, load_format="safetensors"
        )
    with pytest.raises(ValueError, match="at least one engine"):
        TensorWeightSender([], max_bytes=1, dtype=None)
    with pytest.raises(ValueError, match="no tensors"):
        TensorWeightSender([LoadingEngine(_model(0))], max_bytes=1, dtype=None).send(
            [], weight_version="1"
        )


def _engine_main(conn, seed: int, refuse: str | None) -> None:
    """An engine process: answers the weight-sync calls over a pipe as an HTTP engine would."""
    torch.set_num_threads(1)
    model, groups, calls = _model(seed), {}, []
    while True:
        action, kwargs = conn.recv()
        if action == "stop":
            # Plain pickle copies the data: conn.send would share it by a handle of this process.
            conn.send_bytes(pickle.dumps((model.state_dict(), calls)))
            return
        calls.append((action, kwargs.get("flush_cache"), kwargs.get("weight_version"),
                      kwargs.get("load_format"), len(kwargs.get("names", ()))))  # fmt: skip
        if action == refuse:
            conn.send({"success": False, "message": f"engine refuses {action}"})
            continue
        try:
            if action == "init_weights_update_group":
                rank = kwargs.pop("rank_offset")
                groups[kwargs["group_name"]] = create_weight_update_group(
                    **kwargs, rank=rank, timeout_s=20
                )
            elif action == "update_weights_from_distributed":
                group = groups[kwargs["group_name"]]
                receive = receive_flattened if kwargs.get("load_format") else receive_tensors
                named = receive(group, kwargs["names"], kwargs["dtypes"], kwargs["shapes"], "cpu")
                load_named_tensors(model, named)
            elif action == "destroy_weights_update_group":
                groups.pop(kwargs["group_name"]).destroy()
            conn.send(OK)
        except Exception as err:
            conn.send({"success": False, "message": repr(err)})


class PipeEngine:
    """The engine client interface, forwarded to an `_engine_main` process."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()  # like one HTTP connection per request: replies never mix

    def _ask(self, action: str, **kwargs):
        with self.lock:
            self.conn.send((action, kwargs))
            return self.conn.recv()

    def init_weights_update_group(
        self, master_address, master_port, rank_offset, world_size, group_name, backend
    ):
        return self._ask("init_weights_update_group", master_address=master_address,
                         master_port=master_port, rank_offset=rank_offset, world_size=world_size,
                         group_name=group_name, backend=backend)  # fmt: skip

    def update_weights_from_distributed(
        self, names, dtypes, shapes, group_name, flush_cache, weight_version, **load_format
    ):
        return self._ask("update_weights_from_distributed", names=names, dtypes=dtypes,
                         shapes=shapes, group_name=group_name, flush_cache=flush_cache,
                         weight_version=weight_version, **load_format)  # fmt: skip

    def destroy_weights_update_group(self, group_name):
        return self._ask("destroy_weights_update_group", group_name=group_name)

    def stop(self):
        self.conn.send(("stop", {}))
        return pickle.loads(self.conn.recv_bytes())


@contextlib.contextmanager
def engine_processes(count: int, refuse: str | None = None):
    ctx = context()
    engines, processes = [], []
    for _ in range(count):
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=_engine_main, args=(theirs, 0, refuse), daemon=True)
        process.start()
        engines.append(PipeEngine(ours))
        processes.append(process)
    try:
        yield engines
    finally:
        for process in processes:
            process.join(timeout=0.1)
            if process.is_alive():
                process.kill()
                process.join()


def _sender(engines, **overrides) -> DistributedWeightSender:
    settings = {"master_address": "127.0.0.1", "master_port": free_port(), "group_name": "g",
                "backend": "gloo", "max_bytes": 200, "dtype": torch.bfloat16, "timeout_s": 20}  # fmt: skip
    return DistributedWeightSender(engines, **{**settings, **overrides})


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_distributed_sender_broadcasts_every_bucket_to_every_engine(load_format):
    trainer = _model(1)
    names = list(trainer.state_dict())
    with engine_processes(2) as engines:
        # One bucket for the whole model: bf16 weights and an int64 buffer in it.
        sender = _sender(engines, load_format=load_format, max_bytes=1 << 20)
        assert sender.world_size == 3
        with sender:
            count = sender.send(trainer.state_dict().items(), weight_version="4")
        results = [engine.stop() for engine in engines]
    assert count == 1
    for rank, (state, calls) in enumerate(results, start=1):
        _assert_state(state, _expected(trainer))
        updates = [c for c in calls if c[0] == "update_weights_from_distributed"]
        assert {version for _, _, version, _, _ in updates} == {"4"}
        assert [flush for _, flush, _, _, _ in updates] == [False] * (len(updates) - 1) + [True]
        # Flat: one call (one broadcast) per dtype, in order of appearance (the int64 buffer is
        # the root module's, first); else one call for every tensor.
        tensors = [n for _, _, _, _, n in updates]
        assert tensors == ([1, len(names) - 1] if load_format else [len(names)]), rank
        assert {fmt for _, _, _, fmt, _ in updates} == {load_format}
        assert [c[0] for c in calls][0 :: len(calls) - 1] == [
            "init_weights_update_group",
            "destroy_weights_update_group",
        ], f"engine rank {rank}"


def test_engine_refusing_a_bucket_is_raised_at_once_not_after_the_group_timeout():
    with engine_processes(2, refuse="update_weights_from_distributed") as engines:
        sender = _sender(engines, timeout_s=20)
        sender.connect()
        start = time.monotonic()
        with pytest.raises(
            WeightSyncError, match=r"engine [01] refused update_weights_from_distributed"
        ):
            sender.send(_model(1).state_dict().items(), weight_version="1")
        assert time.monotonic() - start < 10
        with pytest.raises(RuntimeError, match="failed midway; call close\\(\\) and connect\\(\\)"):
            sender.send(_model(1).state_dict().items(), weight_version="2")
        sender.close()


def test_engine_refusing_to_join_is_raised_with_its_message_when_the_rendezvous_gives_up():
    with engine_processes(1, refuse="init_weights_update_group") as engines:
        sender = _sender(engines, timeout_s=2)
        with pytest.raises(
            WeightSyncError, match="engine refuses init_weights_update_group"
        ) as info:
            sender.connect()
        assert info.value.engine_messages == {0: "engine refuses init_weights_update_group"}
        with pytest.raises(RuntimeError, match=r"call connect\(\) first"):
            sender.send([("w", torch.ones(1))], weight_version="1")
