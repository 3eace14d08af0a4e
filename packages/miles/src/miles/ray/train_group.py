"""A training group: one Ray actor per rank of the chosen backend, driven as one object.

Every call goes to every rank (most are collectives) and waits for all of them; rank 0's answer is
returned. Rank r sits in the placement bundle of train rank r; rank 0's node address and a free port
there are found first, because every rank needs them to join the process group.

Each rank's Ray actor is a `TrainRank`, which builds the backend's `TrainRayActor` inside its own
process from the class's import path: the driver never imports a backend (its actor module brings
torch and the model code, seconds of imports before the first rollout).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import ray
from miles.backends.training_utils.algorithms.loss_config import LossConfig
from miles.backends.training_utils.infra.import_path import load_object
from miles.config.placement_plan import COLOCATED_TRAIN_SHARE
from miles.config.trainer_args import TrainerArgs
from miles.ray.placement import Placement
from miles.train_backend.run_spec import TrainRunSpec
from miles.utils.failures import describe

logger = logging.getLogger(__name__)

# After one rank's call fails, how long the others get to fail too: a rank that died makes its
# peers fail in their next collective, and the dead one is the cause to report.
_FAILURE_GRACE_S = 5.0


class TrainRankError(RuntimeError):
    """A train rank's call failed or its process died: which rank, where, and why.
    `rank_lost`: a rank died or hung (the group is broken); False where every rank is alive and
    one raised (in a weight push, possibly for an engine that died under it)."""

    def __init__(self, message: str, *, rank_lost: bool = True) -> None:
        super().__init__(message)
        self.rank_lost = rank_lost


@ray.remote(num_cpus=0)
def _master_address(host: str | None) -> tuple[str, int]:
    """Run in rank 0's bundle: `host` (default: this node's address) and a port free on it."""
    host = host or ray.util.get_node_ip_address()
    with socket.socket() as sock:
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    return host, port


class TrainRank:
    """One rank's Ray actor: it builds the backend's `TrainRayActor` in this process and runs the
    group's calls on it."""

    def __init__(
        self, actor_class: type | str, *args: Any, torch_threads: int | None = None
    ) -> None:
        """`torch_threads`: this rank's torch threads on a CPU-only run (`miles.ray.cpu_threads`),
        set before the backend builds anything; None: what Ray's OMP_NUM_THREADS gives."""
        start = time.perf_counter()
        if torch_threads is not None:
            import torch  # the backend imports it next anyway

            torch.set_num_threads(torch_threads)
        if isinstance(actor_class, str):
            actor_class = load_object(actor_class, "--train-backend")
        self.actor = actor_class(*args)
        self.startup_seconds = {"trainer_imports": time.perf_counter() - start}

    def init(self, *args: Any, **kwargs: Any) -> int:
        """`TrainRayActor.init`, timed: the model, optimizer and process group's build."""
        start = time.perf_counter()
        try:
            return self.actor.init(*args, **kwargs)
        finally:
            self.startup_seconds["trainer_build"] = time.perf_counter() - start

    def get_startup_seconds(self) -> dict[str, float]:
        return dict(self.startup_seconds)

    def where(self) -> str:
        """ "pid P on node A": where this rank runs (for messages about it)."""
        return f"pid {os.getpid()} on node {ray.util.get_node_ip_address()}"

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.actor, method)(*args, **kwargs)


class RayTrainGroup:
    """`world_size` ranks of `actor_class` (a TrainRayActor subclass, or its "module:Class" path:
    the registered backend's, `plugins.plugin_path`) placed by `placement`."""

    def __init__(
        self,
        actor_class: type | str,
        placement: Placement,
        *,
        world_size: int,
        colocate: bool,
        has_gpus: bool,
        cpus_per_bundle: float = 1.0,
        call_timeout_s: float = 3600.0,
        critic: bool = False,
        cpu_threads: Sequence[int] | None = None,
    ):
        """`call_timeout_s` bounds the wait for every rank's answer to one call
        (--train-call-timeout-s). `critic`: the ranks of a critic of its own, on the
        placement's critic bundles (init them with role "critic"). `cpu_threads`: torch
        threads of each rank (`CpuThreads.train` or `.critic`); None: leave torch's default."""
        if not call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be positive, got {call_timeout_s}")
        self.call_timeout_s = call_timeout_s
        self.kind = "critic" if critic else "train"  # how messages name a rank
        self._hung: set[int] = set()  # ranks that did not answer within the bound: killed at once
        share = COLOCATED_TRAIN_SHARE if colocate else 1.0
        schedule = placement.critic_scheduling if critic else placement.actor_scheduling
        master_addr, master_port = ray.get(
            _master_address.options(scheduling_strategy=schedule(0)).remote(placement.bind_host),
            timeout=call_timeout_s,
        )
        remote_class = ray.remote(TrainRank)
        threads = [None] * world_size if cpu_threads is None else list(cpu_threads)
        self.actors = [
            remote_class.options(
                num_cpus=share * cpus_per_bundle,
                num_gpus=share if has_gpus else 0,
                scheduling_strategy=schedule(rank),
            ).remote(
                actor_class, rank, world_size, master_addr, master_port, torch_threads=threads[rank]
            )
            for rank in range(world_size)
        ]
        self.world_size = world_size
        self.places = [f"rank {rank}" for rank in range(world_size)]  # `where`, after init
        # Which rollout shard each rank trains on; known from the backend after `init`.
        self.dp_ranks = list(range(world_size))
        name = actor_class if isinstance(actor_class, str) else actor_class.__name__
        logger.info(
            "%s group of %d %s rank(s); rank 0 at %s:%d",
            self.kind,
            world_size,
            name,
            master_addr,
            master_port,
        )

    def _all(self, method: str, *args: Any) -> list[ray.ObjectRef]:
        return [actor.call.remote(method, *args) for actor in self.actors]

    def _gather(self, calls: list[ray.ObjectRef], what: str) -> list[Any]:
        """The results of one call per rank, in rank order. The first failure stops the wait:
        it is raised as a TrainRankError naming the rank, preferring a rank whose process died
        (its peers only fail after it), and the ranks that never answered. Ranks that have not
        answered within `call_timeout_s` are a TrainRankError naming them."""
        pending = {call: rank for rank, call in enumerate(calls)}
        results: dict[int, Any] = {}
        failures: dict[int, BaseException] = {}
        deadline = time.monotonic() + self.call_timeout_s
        while pending and time.monotonic() < deadline:
            timeout = max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            for call in ready:
                rank = pending.pop(call)
                try:
                    results[rank] = ray.get(call)
                except Exception as err:
                    failures[rank] = err
                    if len(failures) == 1:
                        deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
        if not failures and pending:
            self._hung.update(pending.values())
            silent = ", ".join(f"rank {r} ({self.places[r]})" for r in sorted(pending.values()))
            raise TrainRankError(
                f"no answer to {what} within {self.call_timeout_s:g} s (--train-call-timeout-s) "
                f"from {self.kind} {silent}; a rank is hung outside any collective, or the call needs "
                "more time: raise --train-call-timeout-s"
            )
        if not failures:
            return [results[rank] for rank in range(len(calls))]
        died = [
            rank for rank, err in failures.items() if isinstance(err, ray.exceptions.RayActorError)
        ]
        rank = min(died or failures)
        raise self._rank_error(rank, what, failures[rank], silent=sorted(pending.values()))

    def _rank_error(
        self, rank: int, what: str, err: BaseException, *, silent: list[int]
    ) -> TrainRankError:
        died = isinstance(err, ray.exceptions.RayActorError)
        if died:
            how, cause = "died", str(err).strip().splitlines()[0]
        else:
            how, cause = "failed", describe(err)  # the rank's own exception, unwrapped
        text = (
            f"{self.kind} rank {rank} of {self.world_size} ({self.places[rank]}) {how} in {what}: "
            f"{cause}"
        )
        if silent:
            text += "; no answer from " + ", ".join(f"rank {r} ({self.places[r]})" for r in silent)
        return TrainRankError(text, rank_lost=died or bool(silent))

    def init(
        self,
        spec: TrainRunSpec,
        loss: LossConfig,
        backend: TrainerArgs,
        *,
        role: str = "actor",
        with_ref: bool = False,
    ) -> int:
        """Build every rank; returns the rollout id to start from (the same on every rank)."""
        # Where each rank runs, first: a failure or a hang in init then names its process.
        self.places = self._gather([actor.where.remote() for actor in self.actors], "start-up")
        calls = [
            actor.init.remote(spec, loss, backend, role=role, with_ref=with_ref)
            for actor in self.actors
        ]
        starts = self._gather(calls, "init")
        if len(set(starts)) != 1:
            raise RuntimeError(
                f"train ranks disagree on the rollout to resume from: {starts}; the checkpoint "
                "in --load is inconsistent across ranks"
            )
        dp_ranks = self._gather(self._all("data_parallel_rank"), "data_parallel_rank")
        if sorted(set(dp_ranks)) != list(range(len(set(dp_ranks)))):
            raise RuntimeError(
                f"the train ranks report data-parallel ranks {dp_ranks}; they must number the "
                "replicas 0..n-1 (a backend bug)"
            )
        self.dp_ranks = dp_ranks
        return starts[0]

    def startup_seconds(self) -> dict[str, float]:
        """Rank 0's import and build times, measured in its process (`TrainRank`)."""
        return ray.get(self.actors[0].get_startup_seconds.remote(), timeout=self.call_timeout_s)

    @property
    def dp_size(self) -> int:
        """Model replicas: the number of rollout shards one train call takes."""
        return len(set(self.dp_ranks))

    def _shards(self, data: list[Any]) -> list[Any]:
        """Rank r's shard of `data` (one per data-parallel replica): its replica's."""
        if len(data) != self.dp_size:
            raise ValueError(
                f"got {len(data)} data shards for {self.dp_size} data-parallel replicas "
                f"({self.world_size} train ranks)"
            )
        return [data[r] for r in self.dp_ranks]

    def per_replica(self, results: list[Any]) -> list[Any]:
        """One result per data-parallel replica, in replica order, from per-rank `results`:
        the ranks of one replica hold the same shard, so the first rank's answers for it."""
        first: dict[int, Any] = {}
        for dp_rank, result in zip(self.dp_ranks, results, strict=True):
            first.setdefault(dp_rank, result)
        return [first[r] for r in range(self.dp_size)]

    def on_shards(self, method: str, rollout_id: int | None, *columns: list[Any]) -> list[Any]:
        """`method([rollout_id,] shard, *rest)` on every rank, with its replica's entry of each
        per-replica list in `columns` (the data shards first); every rank's result."""
        lead = () if rollout_id is None else (rollout_id,)
        per_rank = zip(*(self._shards(column) for column in columns), strict=True)
        calls = [
            actor.call.remote(method, *lead, *args)
            for actor, args in zip(self.actors, per_rank, strict=True)
        ]
        what = method if rollout_id is None else f"{method} (rollout {rollout_id})"
        return self._gather(calls, what)

    def async_train(self, rollout_id: int, data: list[ray.ObjectRef]) -> list[ray.ObjectRef]:
        """Start training every rank on its replica's shard of `data`; returns the calls'
        references."""
        shards = self._shards(data)
        return [
            a.call.remote("train", rollout_id, d) for a, d in zip(self.actors, shards, strict=True)
        ]

    def train(self, rollout_id: int, data: list[ray.ObjectRef]) -> Any:
        return self._gather(self.async_train(rollout_id, data), f"train (rollout {rollout_id})")[0]

    def logprob_gap(self, data: list[ray.ObjectRef]) -> float:
        """Mean |trainer - engine| log-prob over the response tokens of `data` (no training)."""
        shards = self._shards(data)
        calls = [a.call.remote("logprob_gap", d) for a, d in zip(self.actors, shards, strict=True)]
        return self._gather(calls, "logprob_gap")[0]

    def call(self, method: str, *args: Any) -> Any:
        """Run `method(*args)` on every rank; rank 0's result."""
        return self._gather(self._all(method, *args), method)[0]

    def save_model(
        self, rollout_id: int, commit: bool = True, weight_version: int | None = None
    ) -> None:
        self.call("save_model", rollout_id, commit, weight_version)

    def commit_checkpoint(self, rollout_id: int) -> None:
        self.call("commit_checkpoint", rollout_id)

    def connect_engines(self, engine_urls: list[str], admin_api_key: str | None = None) -> None:
        """The engines every rank pushes its weights to (see `TrainRayActor.connect_engines`)."""
        self.call("connect_engines", engine_urls, admin_api_key)

    def update_weights(self) -> int:
        """Push the weights to the engines as the next version; returns that version."""
        return self.call("update_weights")

    def rejoin(self, weight_version: int | None, generation: int) -> None:
        """A restarted group takes up the engines' weight version (`TrainRayActor.rejoin`)."""
        self.call("rejoin", weight_version, generation)

    def restore_engines(self, engine_urls: list[str]) -> int:
        """Push the current weights to restarted engines; the weight version they now hold."""
        return self.call("restore_engines", engine_urls)

    def sleep(self) -> None:
        self.call("sleep")

    def wake_up(self) -> None:
        self.call("wake_up")

    def export_hf(self, path: str) -> None:
        self.call("export_hf", path)

    def node_ids(self) -> list[str]:
        calls = [a.__ray_call__.remote(lambda self: _node_id()) for a in self.actors]
        return self._gather(calls, "node_ids")

    def shutdown(self, *, hurry: bool = False) -> None:
        """Release each rank's resources (engine clients, groups), then end the actors;
        `hurry`: end them without asking."""
        live = [a for rank, a in enumerate(self.actors) if rank not in self._hung]
        try:
            if not hurry:
                ray.get([actor.call.remote("close") for actor in live], timeout=60)
        except Exception as exc:  # a dead rank must not keep the others alive
            logger.warning("closing the train group: %s", exc)
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


def _node_id() -> str:
    return ray.get_runtime_context().get_node_id()
