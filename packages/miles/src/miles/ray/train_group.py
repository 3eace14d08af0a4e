"""A training group: one Ray actor per rank of the chosen backend, driven as one object.

Every call goes to every rank (most are collectives) and waits for all of them; rank 0's answer is
returned. Rank r sits in the placement bundle of train rank r; rank 0's node address and a free port
there are found first, because every rank needs them to join the process group.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import ray
from miles.backends.training_utils.loss_config import LossConfig
from miles.config.trainer_args import TrainerArgs
from miles.ray.placement import Placement
from miles.ray.placement_plan import COLOCATED_TRAIN_SHARE
from miles.ray.train_actor import TrainRunSpec

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
def _master_address() -> tuple[str, int]:
    """Run in rank 0's bundle: this node's address and a port free on it."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


class RayTrainGroup:
    """`world_size` actors of `actor_class` (a TrainRayActor subclass) placed by `placement`."""

    def __init__(
        self,
        actor_class: type,
        placement: Placement,
        *,
        world_size: int,
        colocate: bool,
        has_gpus: bool,
        cpus_per_bundle: float = 1.0,
    ):
        share = COLOCATED_TRAIN_SHARE if colocate else 1.0
        master_addr, master_port = ray.get(
            _master_address.options(scheduling_strategy=placement.actor_scheduling(0)).remote()
        )
        remote_class = ray.remote(actor_class)
        self.actors = [
            remote_class.options(
                num_cpus=share * cpus_per_bundle,
                num_gpus=share if has_gpus else 0,
                scheduling_strategy=placement.actor_scheduling(rank),
            ).remote(rank, world_size, master_addr, master_port)
            for rank in range(world_size)
        ]
        self.world_size = world_size
        # Which rollout shard each rank trains on; known from the backend after `init`.
        self.dp_ranks = list(range(world_size))
        logger.info(
            "train group of %d %s actor(s); rank 0 at %s:%d",
            world_size, actor_class.__name__, master_addr, master_port,
        )  # fmt: skip

    def _all(self, method: str, *args: Any) -> list[ray.ObjectRef]:
        return [getattr(actor, method).remote(*args) for actor in self.actors]

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
        calls = [
            actor.init.remote(spec, loss, backend, role=role, with_ref=with_ref)
            for actor in self.actors
        ]
        starts = ray.get(calls)
        if len(set(starts)) != 1:
            raise RuntimeError(
                f"train ranks disagree on the rollout to resume from: {starts}; the checkpoint "
                "in --load is inconsistent across ranks"
            )
        dp_ranks = ray.get(self._all("data_parallel_rank"))
        if sorted(set(dp_ranks)) != list(range(len(set(dp_ranks)))):
            raise RuntimeError(
                f"the train ranks report data-parallel ranks {dp_ranks}; they must number the "
                "replicas 0..n-1 (a backend bug)"
            )
        self.dp_ranks = dp_ranks
        return starts[0]

    @property
    def dp_size(self) -> int:
        """Model replicas: the number of rollout shards one train call takes."""
        return len(set(self.dp_ranks))

    def _shards(self, data: list[ray.ObjectRef]) -> list[ray.ObjectRef]:
        """Rank r's shard of `data` (one per data-parallel replica): its replica's."""
        if len(data) != self.dp_size:
            raise ValueError(
                f"got {len(data)} data shards for {self.dp_size} data-parallel replicas "
                f"({self.world_size} train ranks)"
            )
        return [data[r] for r in self.dp_ranks]

    def async_train(self, rollout_id: int, data: list[ray.ObjectRef]) -> list[ray.ObjectRef]:
        """Start training every rank on its replica's shard of `data`; returns the calls'
        references."""
        shards = self._shards(data)
        return [a.train.remote(rollout_id, d) for a, d in zip(self.actors, shards, strict=True)]

    def train(self, rollout_id: int, data: list[ray.ObjectRef]) -> Any:
        return ray.get(self.async_train(rollout_id, data))[0]

    def logprob_gap(self, data: list[ray.ObjectRef]) -> float:
        """Mean |trainer - engine| log-prob over the response tokens of `data` (no training)."""
        shards = self._shards(data)
        calls = [a.logprob_gap.remote(d) for a, d in zip(self.actors, shards, strict=True)]
        return ray.get(calls)[0]

    def call(self, method: str, *args: Any) -> Any:
        """Run `method(*args)` on every rank; rank 0's result."""
        return ray.get(self._all(method, *args))[0]

    def save_model(self, rollout_id: int) -> None:
        self.call("save_model", rollout_id)

    def update_weights(self) -> None:
        self.call("update_weights")

    def sleep(self) -> None:
        self.call("sleep")

    def wake_up(self) -> None:
        self.call("wake_up")

    def export_hf(self, path: str) -> None:
        self.call("export_hf", path)

    def node_ids(self) -> list[str]:
        return ray.get([a.__ray_call__.remote(lambda self: _node_id()) for a in self.actors])

    def shutdown(self) -> None:
        """Release each rank's resources (engine clients, groups), then end the actors."""
        try:
            ray.get(self._all("close"), timeout=60)
        except Exception as exc:  # a dead rank must not keep the others alive
            logger.warning("closing the train group: %s", exc)
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


def _node_id() -> str:
    return ray.get_runtime_context().get_node_id()
