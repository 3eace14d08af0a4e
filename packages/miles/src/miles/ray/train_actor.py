"""The training-backend contract (DESIGN §3.1): what every train actor class provides.

A backend (FSDP, Megatron) subclasses `TrainRayActor`; the train loop wraps the class in a Ray actor
and sends every rank of a group the same calls. Process-group set-up is shared here, with rank 0 as
the master. This module imports neither Ray nor any backend, so core stays backend-free.
"""

from __future__ import annotations

import abc
import datetime
import logging
import os
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist

from miles.backends.training_utils.device import dist_backend

logger = logging.getLogger(__name__)

Role = Literal["actor", "critic"]
ROLES: tuple[str, ...] = ("actor", "critic")

# How long a rank waits in init_process_group for the others (slow first imports on big clusters).
DEFAULT_TIMEOUT_S = 1800.0


class TrainRayActor(abc.ABC):
    """One rank of a training group.

    Every rank of the group receives the same calls, in the same order: most of them run
    collectives, so a call made on some ranks only hangs. `data_ref` in `train` is this rank's
    data-parallel shard (a columnar `RolloutBatch`, or a Ray object reference to one).
    """

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"train actor rank {rank} of world size {world_size}: need world_size >= 1 and "
                f"0 <= rank < world_size; the placement must create one actor per rank"
            )
        if not 0 < int(master_port) < 65536:
            raise ValueError(
                f"master_port {master_port} is not a TCP port (1-65535); rank 0 picks a free one"
            )
        if not master_addr:
            raise ValueError("master_addr is empty; pass the address of rank 0's node")
        self.rank = rank
        self.world_size = world_size
        self.master_addr = master_addr
        self.master_port = int(master_port)

    @property
    def local_rank(self) -> int:
        """This process's device index on its node. Ray gives each actor its own device, so the
        default is 0; a launcher that shares devices between processes sets $LOCAL_RANK."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    def setup_distributed(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Join the group's default process group (gloo on CPU, nccl / hccl on accelerators).

        Sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE so libraries that read them agree.
        Idempotent within a process: an existing group with this rank and size is kept; one with
        another rank or size is an error, because every collective would then pair the wrong ranks.
        """
        os.environ["MASTER_ADDR"] = self.master_addr
        os.environ["MASTER_PORT"] = str(self.master_port)
        os.environ["RANK"] = str(self.rank)
        os.environ["WORLD_SIZE"] = str(self.world_size)
        if dist.is_initialized():
            found = (dist.get_rank(), dist.get_world_size())
            if found != (self.rank, self.world_size):
                raise RuntimeError(
                    f"this process already joined a process group as rank {found[0]} of "
                    f"{found[1]}, but the actor is rank {self.rank} of {self.world_size}; run one "
                    "train actor per process"
                )
            logger.info("rank %d: process group already initialized; keeping it", self.rank)
            return
        backend = dist_backend()
        logger.info(
            "rank %d of %d: joining the %s process group at %s:%d",
            self.rank, self.world_size, backend, self.master_addr, self.master_port,
        )  # fmt: skip
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{_host_for_url(self.master_addr)}:{self.master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    @abc.abstractmethod
    def init(self, args: Any, role: Role, with_ref: bool) -> int:
        """Build model, optimizer and groups; resume from a checkpoint if asked.

        Returns the rollout id to start from: 0 for a fresh run, the saved id + 1 on resume.
        `with_ref` asks for a frozen reference model (KL to the initial policy).
        """

    @abc.abstractmethod
    def train(self, rollout_id: int, data_ref: Any) -> Any:
        """Take this rollout's optimizer steps on this rank's shard of the train data."""

    @abc.abstractmethod
    def save_model(self, rollout_id: int) -> None:
        """Write a resumable checkpoint of model, optimizer and schedule for `rollout_id`."""

    @abc.abstractmethod
    def update_weights(self) -> None:
        """Push the current weights to the rollout engines and bump the weight version."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Move training state to host memory so colocated engines can use the device."""

    @abc.abstractmethod
    def wake_up(self) -> None:
        """Bring the state moved by `sleep` back onto the device."""

    @abc.abstractmethod
    def export_hf(self, path: str | Path) -> None:
        """Write the current weights as a Hugging Face checkpoint directory."""

    def data_parallel_rank(self) -> int:
        """Which data-parallel shard of each rollout this rank trains on (valid after `init`).

        Ranks that split one model replica (tensor / pipeline parallel peers) must see the same
        samples, so they share a shard; by default every rank is a replica of its own.
        """
        return self.rank

    def logprob_gap(self, data_ref: Any) -> float:
        """Mean |trainer - engine| log-prob over the response tokens of `data_ref` (all ranks).

        The step-0 check of DESIGN §3.4: after the first weight update the two must agree. A
        backend that cannot compute it says so, and the run is told how to skip the check.
        """
        raise NotImplementedError(
            f"the {type(self).__name__} backend has no step-0 log-prob check; pass "
            "--check-weight-sync-tolerance none to skip it"
        )

    def close(self) -> None:
        """Release what the rank holds beyond its process (engine clients, weight-update groups).

        Called before the train group's actors end; the process group stays, since a backend may
        re-create its engine connections after `close` (e.g. to switch transports). A backend
        that holds nothing beyond its process has nothing to release.
        """
        logger.debug("rank %d: %s holds nothing to release", self.rank, type(self).__name__)


def _host_for_url(address: str) -> str:
    # An IPv6 literal needs brackets inside a tcp:// URL.
    return f"[{address}]" if ":" in address and not address.startswith("[") else address
