"""Trainer side: push full parameters to the engines bucket by bucket, colocated or disaggregated.

Backends (FSDP, Megatron) hand over `(name, tensor)` pairs of full parameters; a sender buckets,
casts and ships them, and turns an engine's `success: false` into a `WeightSyncError`. The KV
cache is flushed with the last bucket only (as slime does), once the weights are complete.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any, Literal, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from miles.backends.sglang_utils.weight_sync.buckets import (
    FlattenedBucket,
    _validate,
    dtype_name,
    unflatten_bucket,
)
from miles.backends.sglang_utils.weight_sync.distributed_transport import (
    FLATTENED_BUCKET,
    WeightUpdateGroup,
    create_weight_update_group,
)
from miles.backends.sglang_utils.weight_sync.staging import StagingBuffers, pack_buckets
from miles.backends.sglang_utils.weight_sync.tensor_transport import (
    serialize_flattened_bucket,
    serialize_named_tensors,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

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
        self._dtype, self._load_format = dtype, load_format
        # Shared memory the engines map by name: allocated at the first send, kept until close().
        self._staging = StagingBuffers(max_bytes, shared=True)

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], *, weight_version: str) -> int:
        """Send every tensor, bucket by bucket, to every engine; return the number of buckets.
        Each bucket is packed while the engines load the one before (`_pipelined`)."""

        def start_bucket(bucket: FlattenedBucket, is_last: bool) -> list[Future]:
            if self._load_format == "flattened_bucket":
                payload: Callable[[], str] = lambda: serialize_flattened_bucket(bucket)  # noqa: E731
            else:  # SGLang's list of named tensors: views of the staging buffer, by handle
                named = unflatten_bucket(bucket)
                payload = lambda: serialize_named_tensors(named)  # noqa: E731
            return [
                _start(_call, index, client, "update_weights_from_tensor",
                       serialized_named_tensors=[payload()], load_format=self._load_format,
                       flush_cache=is_last, weight_version=weight_version)
                for index, client in enumerate(self._clients)
            ]  # fmt: skip

        def finish_bucket(calls: list[Future]) -> None:
            _wait_all(calls, "update_weights_from_tensor")

        return _pipelined(
            named_tensors, self._staging, self._dtype, start_bucket, finish_bucket,
            engines=len(self._clients), weight_version=weight_version,
        )  # fmt: skip

    def close(self) -> None:
        """Free the staging buffers (their segments go once the engines dropped them too)."""
        self._staging.release()


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
        self._dtype, self._load_format = dtype, load_format
        self._staging = StagingBuffers(max_bytes, shared=False)  # kept from send to send
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
        group = self._group

        def start_bucket(bucket: FlattenedBucket, is_last: bool) -> _Broadcast:
            self._out_of_step = True  # until this bucket is through on every rank
            if self._load_format != FLATTENED_BUCKET:
                named = unflatten_bucket(bucket)
                metadata = [(name, dtype_name(t.dtype), list(t.shape)) for name, t in named]
                return self._broadcast(group, metadata, [t for _, t in named], flush=is_last,
                                       weight_version=weight_version)  # fmt: skip
            # One call and one broadcast per dtype, in order of appearance; all but the last
            # are waited for here, so an engine never has two of them to order.
            regions = list(bucket.flat.items())
            for index, (kind, flat) in enumerate(regions):
                metadata = [
                    (m.name, kind, list(m.shape)) for m in bucket.metadata if m.dtype == kind
                ]
                last = index == len(regions) - 1
                sent = self._broadcast(group, metadata, [flat], flush=is_last and last,
                                       weight_version=weight_version, load_format=FLATTENED_BUCKET)  # fmt: skip
                if last:
                    return sent
                sent.wait()
            raise AssertionError("a packed bucket has at least one region")

        def finish_bucket(sent: _Broadcast) -> None:
            sent.wait()
            self._out_of_step = False

        return _pipelined(
            named_tensors, self._staging, self._dtype, start_bucket, finish_bucket,
            engines=len(self._clients), weight_version=weight_version,
        )  # fmt: skip

    def _broadcast(
        self, group: WeightUpdateGroup, metadata: list[tuple[str, str, list[int]]],
        tensors: list[Tensor], *, flush: bool, weight_version: str, load_format: str | None = None,
    ) -> _Broadcast:  # fmt: skip
        """Start one update call per engine for the tensors `metadata` names (name, dtype,
        shape), which travel as `tensors`: themselves, or one flat tensor with `load_format`."""
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
        return _Broadcast(
            posts, works, f"{len(self._clients)} engines to receive {len(metadata)} tensors"
        )

    def close(self) -> None:
        """Destroy the group on every engine and here, and free the staging buffers
        (idempotent)."""
        group, self._group = self._group, None
        self._out_of_step = False
        self._staging.release()
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


class _Broadcast:
    """One bucket's engine calls and broadcasts, in flight."""

    def __init__(self, posts: list[Future], works: list[dist.Work], what: str) -> None:
        self.posts, self.works, self.what = posts, works, what

    def wait(self) -> None:
        _wait_fail_fast(self.posts, self.works, self.what)


def _pipelined(
    named_tensors: Iterable[tuple[str, Tensor]],
    staging: StagingBuffers,
    dtype: torch.dtype | None,
    start: Callable[[FlattenedBucket, bool], T],
    finish: Callable[[T], None],
    *,
    engines: int,
    weight_version: str,
) -> int:
    """Send every tensor, packed into `staging` bucket by bucket: `start` one, pack the next
    (into the other staging buffer) while the engines receive it, then `finish` it before
    starting the next, so each engine handles one bucket at a time, in order. Returns the number
    of buckets; the staging buffers are trimmed afterwards (`StagingBuffers.trim`)."""
    began, count, nbytes = time.monotonic(), 0, 0
    in_flight: T | None = None
    try:
        for bucket, is_last in pack_buckets(named_tensors, staging, dtype=dtype):  # packs here
            if in_flight is not None:
                sent, in_flight = in_flight, None
                finish(sent)
            in_flight = start(bucket, is_last)
            count += 1
            nbytes += sum(flat.numel() * flat.element_size() for flat in bucket.flat.values())
        if in_flight is not None:
            sent, in_flight = in_flight, None
            finish(sent)
    finally:
        if in_flight is not None:  # packing failed: the engines still read the other buffer
            with contextlib.suppress(Exception):
                finish(in_flight)
        staging.trim()
    _check_sent(count)
    _log_sent(count, nbytes, engines, time.monotonic() - began, weight_version)
    return count


def _check_sent(buckets: int) -> None:
    # An empty update would leave the engines' weight version behind the trainer's, silently.
    if buckets == 0:
        raise ValueError("the weight sender got no tensors; the trainer handed over no parameters")


def _log_sent(buckets: int, nbytes: int, engines: int, seconds: float, weight_version: str) -> None:
    logger.info(
        "sent %d buckets (%.1f MiB) to %d engines in %.2f s; weight version %s",
        buckets, nbytes / 2**20, engines, seconds, weight_version,
    )  # fmt: skip
