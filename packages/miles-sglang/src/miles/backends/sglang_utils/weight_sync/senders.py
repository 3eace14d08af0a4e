"""Trainer side: push full parameters to the engines bucket by bucket, colocated or disaggregated.

Backends (FSDP, Megatron) hand over `(name, tensor)` pairs of full parameters; a sender buckets,
casts and ships them, and turns an engine's `success: false` into a `WeightSyncError`. The KV
cache is flushed with the last bucket only (as slime does), once the weights are complete.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from miles.backends.sglang_utils.weight_sync.buckets import (
    FlattenedBucket,
    NamedTensors,
    _validate,
    dtype_name,
    flatten_bucket,
    iter_buckets_with_last,
)
from miles.backends.sglang_utils.weight_sync.distributed_transport import (
    FLATTENED_BUCKET,
    WeightUpdateGroup,
    create_weight_update_group,
)
from miles.backends.sglang_utils.weight_sync.tensor_transport import (
    serialize_flattened_bucket,
    serialize_named_tensors,
    share_tensor,
)

logger = logging.getLogger(__name__)

# How often a wait on engines re-checks for a failure, and how often it logs that it is waiting.
_POLL_S = 0.05
_LOG_EVERY_S = 30.0
# After a failed rendezvous, how long to wait for an engine's refusal to explain it.
_REFUSAL_GRACE_S = 10.0


class WeightSyncError(RuntimeError):
    """An engine refused or failed a weight-sync call; `engine_messages` maps engine index to why."""

    def __init__(self, message: str, engine_messages: dict[int, str] | None = None):
        super().__init__(message)
        self.engine_messages = dict(engine_messages or {})


class WeightSyncClient(Protocol):
    """The synchronous engine-client calls the senders use (`SyncEngineClient` provides them)."""

    def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], load_format: str | None, flush_cache: bool,
        weight_version: str | None,
    ) -> dict: ...  # fmt: skip

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str, backend: str,
    ) -> dict: ...  # fmt: skip

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        flush_cache: bool, weight_version: str | None, load_format: str | None = None,
    ) -> dict: ...  # fmt: skip

    def destroy_weights_update_group(self, group_name: str) -> dict: ...


class TensorWeightSender:
    """Colocated: hand each bucket to every engine through shared memory / CUDA IPC handles.

    `None` (the default) sends SGLang's plain list of named tensors, which real SGLang servers and
    the reference engine both read. `load_format="flattened_bucket"` packs a bucket into one
    tensor per dtype (one handle per dtype instead of one per tensor) in miles's own layout,
    which only the reference engine reads. Each engine gets a one-entry `serialized_named_tensors`
    list: one tensor-parallel rank per engine.
    """

    def __init__(
        self,
        clients: Sequence[WeightSyncClient],
        *,
        max_bytes: int,
        dtype: torch.dtype | None,
        load_format: Literal[None, "flattened_bucket"] = None,
    ):
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(
                f"load_format {load_format!r} is not supported; use None or 'flattened_bucket'"
            )
        _validate(max_bytes, dtype)
        self._clients = _check_clients(clients)
        self._max_bytes, self._dtype, self._load_format = max_bytes, dtype, load_format

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], *, weight_version: str) -> int:
        """Send every tensor, bucket by bucket, to every engine; return the number of buckets."""
        start, count, nbytes = time.monotonic(), 0, 0
        buckets = iter_buckets_with_last(
            named_tensors, max_bytes=self._max_bytes, dtype=self._dtype
        )
        for bucket, is_last in buckets:
            nbytes += _nbytes(bucket)
            self._send_bucket(bucket, is_last=is_last, weight_version=weight_version)
            count += 1
            del bucket  # before the next bucket is gathered: one bucket in memory at a time
        _check_sent(count)
        _log_sent(count, nbytes, len(self._clients), time.monotonic() - start, weight_version)
        return count

    def _send_bucket(self, bucket: NamedTensors, *, is_last: bool, weight_version: str) -> None:
        if self._load_format == "flattened_bucket":
            shared: FlattenedBucket | NamedTensors = flatten_bucket(bucket)
            serialize: Callable[[Any], str] = serialize_flattened_bucket
        else:
            # Share once, serialize per engine: a payload is single-use, the memory is not.
            shared = [(name, share_tensor(tensor)) for name, tensor in bucket]
            serialize = serialize_named_tensors
        calls = [
            _start(_call, index, client, "update_weights_from_tensor",
                   serialized_named_tensors=[serialize(shared)], load_format=self._load_format,
                   flush_cache=is_last, weight_version=weight_version)
            for index, client in enumerate(self._clients)
        ]  # fmt: skip
        # `shared` stays referenced until every engine has answered, i.e. has loaded the bucket.
        _wait_all(calls, "update_weights_from_tensor")


class DistributedWeightSender:
    """Disaggregated: broadcast each bucket from trainer rank 0 to the engines over a process group.

    The group has 1 + len(clients) ranks: this process is rank 0, engine `i` is rank 1 + i.
    Use as a context manager, or call `connect()` once and `close()` at the end.

    `None` (the default) broadcasts each tensor on its own, which every SGLang release reads.
    `load_format="flattened_bucket"` broadcasts a bucket as one flat tensor per dtype (one update
    call each), which the reference engine and SGLang releases with sgl-project/sglang#13824 read:
    one collective instead of one per tensor (46 tensors of 12.8 MB over gloo: 6-10 ms against
    15-18 ms).
    """

    def __init__(
        self,
        clients: Sequence[WeightSyncClient],
        *,
        master_address: str,
        master_port: int,
        group_name: str,
        backend: str,
        max_bytes: int,
        dtype: torch.dtype | None,
        timeout_s: float = 300,
        load_format: Literal[None, "flattened_bucket"] = None,
    ):
        if load_format not in (None, FLATTENED_BUCKET):
            raise ValueError(
                f"load_format {load_format!r} is not supported; use None or {FLATTENED_BUCKET!r}"
            )
        _validate(max_bytes, dtype)
        self._clients = _check_clients(clients)
        self._master_address, self._master_port = master_address, master_port
        self._group_name, self._backend, self._timeout_s = group_name, backend, timeout_s
        self._max_bytes, self._dtype, self._load_format = max_bytes, dtype, load_format
        self._group: WeightUpdateGroup | None = None
        self._out_of_step = False  # a send failed midway: the engines wait on other collectives

    @property
    def world_size(self) -> int:
        return 1 + len(self._clients)

    def connect(self) -> None:
        """Form the group: every engine joins over HTTP while this process joins as rank 0.

        Both sides block until all ranks arrive, so the HTTP calls run in threads. Rank 0 joins in
        this thread, as slime does: a thread left blocked in the C++ rendezvous would abort the
        interpreter if it woke during exit. So an engine that refuses is logged at once but raised
        only when the rendezvous gives up (`timeout_s`), with the engine's message.
        """
        if self._group is not None:
            raise RuntimeError(f"weight update group {self._group_name!r} is already connected")
        where = {"master_address": self._master_address, "master_port": self._master_port}
        common = {**where, "world_size": self.world_size, "group_name": self._group_name,
                  "backend": self._backend}  # fmt: skip
        joins = [
            _start(_call, i, client, "init_weights_update_group", **common, rank_offset=1 + i)
            for i, client in enumerate(self._clients)
        ]
        try:
            group = create_weight_update_group(**common, rank=0, timeout_s=self._timeout_s)
        except Exception as err:
            # An engine's reason beats our rendezvous timeout; its answer may lag under load.
            wait(joins, timeout=_REFUSAL_GRACE_S, return_when=FIRST_EXCEPTION)
            refusals = [f.exception() for f in joins if f.done() and f.exception()]
            if refusals:
                raise refusals[0] from err
            raise
        try:
            _wait_all(joins, "init_weights_update_group")
        except BaseException:
            group.destroy()
            raise
        self._group = group

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], *, weight_version: str) -> int:
        """Broadcast every tensor, bucket by bucket; return the number of buckets.

        After a failure the group is out of step with the engines: `close()` and `connect()` again.
        """
        if self._group is None:
            raise RuntimeError(
                "DistributedWeightSender.send() before connect(); call connect() first"
            )
        if self._out_of_step:
            raise RuntimeError(
                f"an earlier send on {self._group_name!r} failed midway; call close() and connect()"
            )
        start, count, nbytes = time.monotonic(), 0, 0
        buckets = iter_buckets_with_last(
            named_tensors, max_bytes=self._max_bytes, dtype=self._dtype
        )
        for bucket, is_last in buckets:
            nbytes += _nbytes(bucket)
            self._out_of_step = True  # until this bucket is through on every rank
            self._send_bucket(self._group, bucket, is_last=is_last, weight_version=weight_version)
            self._out_of_step = False
            count += 1
            del bucket  # before the next bucket is gathered: one bucket in memory at a time
        _check_sent(count)
        _log_sent(count, nbytes, len(self._clients), time.monotonic() - start, weight_version)
        return count

    def _send_bucket(
        self, group: WeightUpdateGroup, bucket: NamedTensors, *, is_last: bool, weight_version: str
    ) -> None:
        if self._load_format != FLATTENED_BUCKET:
            tensors = [tensor.contiguous() for _, tensor in bucket]
            metadata = [(name, dtype_name(t.dtype), list(t.shape)) for name, t in bucket]
            self._broadcast(group, metadata, tensors, flush=is_last, weight_version=weight_version)
            return
        flattened = flatten_bucket(bucket)  # one flat tensor per dtype, in order of appearance
        for index, (kind, flat) in enumerate(flattened.flat.items()):
            metadata = [
                (m.name, kind, list(m.shape)) for m in flattened.metadata if m.dtype == kind
            ]
            last = is_last and index == len(flattened.flat) - 1
            self._broadcast(group, metadata, [flat], flush=last, weight_version=weight_version,
                            load_format=FLATTENED_BUCKET)  # fmt: skip

    def _broadcast(
        self, group: WeightUpdateGroup, metadata: list[tuple[str, str, list[int]]],
        tensors: list[Tensor], *, flush: bool, weight_version: str, load_format: str | None = None,
    ) -> None:  # fmt: skip
        """One update call per engine for the tensors `metadata` names (name, dtype, shape),
        which travel as `tensors`: themselves, or one flat tensor with `load_format`."""
        extra = {"load_format": load_format} if load_format is not None else {}
        # The engines' handlers allocate and then receive; start them before broadcasting.
        posts = _start_all(
            self._clients, "update_weights_from_distributed",
            names=[name for name, _, _ in metadata], dtypes=[dtype for _, dtype, _ in metadata],
            shapes=[shape for _, _, shape in metadata], group_name=self._group_name,
            flush_cache=flush, weight_version=weight_version, **extra,
        )  # fmt: skip
        # Broadcasts are issued from this thread (NCCL orders them after this thread's stream).
        works = [group.broadcast_async(tensor, src=0) for tensor in tensors]
        _wait_fail_fast(
            posts, works, f"{len(self._clients)} engines to receive {len(metadata)} tensors"
        )

    def close(self) -> None:
        """Destroy the group on every engine and here (idempotent)."""
        group, self._group = self._group, None
        self._out_of_step = False
        if group is None:
            return
        calls = _start_all(
            self._clients, "destroy_weights_update_group", group_name=self._group_name
        )
        group.destroy()
        _wait_all(calls, "destroy_weights_update_group")

    def __enter__(self) -> DistributedWeightSender:
        self.connect()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _check_clients(clients: Sequence[WeightSyncClient]) -> list[WeightSyncClient]:
    if not clients:
        raise ValueError("a weight sender needs at least one engine client, got none")
    return list(clients)


def _start_all(clients: list[WeightSyncClient], action: str, **kwargs: Any) -> list[Future]:
    """Start `client.<action>(**kwargs)` on every engine at once; one future per engine."""
    return [_start(_call, index, client, action, **kwargs) for index, client in enumerate(clients)]


def _call(index: int, client: WeightSyncClient, action: str, **kwargs: Any) -> dict:
    """Call one engine and raise `WeightSyncError` unless it answers `success: true`."""
    try:
        response = getattr(client, action)(**kwargs)
    except Exception as err:
        message = f"{type(err).__name__}: {err}"
        logger.warning("engine %d failed %s: %s", index, action, message)
        raise WeightSyncError(
            f"engine {index} failed {action}: {message}", {index: message}
        ) from err
    if not isinstance(response, dict) or response.get("success") is not True:
        message = response.get("message", "") if isinstance(response, dict) else repr(response)
        # Logged here too: the caller may be blocked in a collective that only times out later.
        logger.warning("engine %d refused %s: %s", index, action, message)
        raise WeightSyncError(f"engine {index} refused {action}: {message}", {index: str(message)})
    return response


def _start(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """Run `fn` in a daemon thread, so an engine call stuck on a dead engine never blocks exit.

    Only for Python-level calls (HTTP): a daemon thread blocked in C++ (a rendezvous, a
    collective) aborts the interpreter if it wakes during exit.
    """
    future: Future = Future()

    def run() -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:
            future.set_exception(err)

    threading.Thread(target=run, name=f"miles-weight-sync-{fn.__name__}", daemon=True).start()
    return future


def _wait_all(futures: list[Future], action: str) -> list:
    """Wait for every call, then raise one `WeightSyncError` naming every engine that failed."""
    wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if not errors:
        return [f.result() for f in futures]
    if len(errors) == 1:
        raise errors[0]
    messages = {
        i: m for e in errors if isinstance(e, WeightSyncError) for i, m in e.engine_messages.items()
    }
    details = "; ".join(str(e) for e in errors)
    raise WeightSyncError(
        f"{len(errors)} of {len(futures)} engines failed {action}: {details}", messages
    )


def _wait_fail_fast(futures: list[Future], works: list[dist.Work], what: str) -> None:
    """Wait for engine calls and broadcasts together; raise the first failure of either at once.

    Without this, an engine that refused a bucket would leave rank 0 blocked in its broadcast
    until the group timeout, and the engine's message would surface minutes later, if at all.
    """
    start = last_log = time.monotonic()
    pending_works = list(works)
    pending = set(futures)
    while pending or pending_works:
        if pending:
            done, pending = wait(pending, timeout=_POLL_S, return_when=FIRST_EXCEPTION)
            for future in done:
                future.result()  # raises the engine's error
        else:
            time.sleep(_POLL_S / 5)
        for work in [w for w in pending_works if w.is_completed()]:
            work.wait()  # raises if the broadcast failed
            pending_works.remove(work)
        if time.monotonic() - last_log > _LOG_EVERY_S:
            last_log = time.monotonic()
            logger.info(
                "still waiting for %s: %d calls and %d broadcasts pending after %.0f s",
                what, len(pending), len(pending_works), last_log - start,
            )  # fmt: skip


def _nbytes(bucket: NamedTensors) -> int:
    return sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)


def _check_sent(buckets: int) -> None:
    # An empty update would leave the engines' weight version behind the trainer's, silently.
    if buckets == 0:
        raise ValueError("the weight sender got no tensors; the trainer handed over no parameters")


def _log_sent(buckets: int, nbytes: int, engines: int, seconds: float, weight_version: str) -> None:
    logger.info(
        "sent %d buckets (%.1f MiB) to %d engines in %.2f s; weight version %s",
        buckets, nbytes / 2**20, engines, seconds, weight_version,
    )  # fmt: skip
