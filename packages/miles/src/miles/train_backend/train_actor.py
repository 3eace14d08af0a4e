"""The training-backend contract (architecture.md: "Contracts / Training backend"): `TrainRayActor`.

A backend subclasses `TrainRayActor` and implements one method, `build_engine`, returning its
`TrainEngine` (training_utils.step.train_engine). Everything else a rank does is here, once: the
process group, the RL step (`PolicyTrainer`), resume, checkpoints, weight pushes to the engines,
sleep / wake. The train loop wraps the class in a Ray actor and sends every rank the same calls.
This module imports neither Ray nor any backend, so core stays backend-free.
"""

from __future__ import annotations

import abc
import dataclasses
import datetime
import logging
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist

from miles.backends.sglang_utils.client import EngineTimeouts
from miles.backends.sglang_utils.weight_sync import (
    WeightUpdater,
    make_lora_adapter_updater,
    make_weight_updater,
)
from miles.backends.training_utils.algorithms.algorithm import Algorithm
from miles.backends.training_utils.algorithms.critic_config import CriticConfig
from miles.backends.training_utils.algorithms.loss_config import LossConfig
from miles.backends.training_utils.batching.rollout_data import RolloutBatch
from miles.backends.training_utils.infra.device import dist_backend, set_device
from miles.backends.training_utils.step.critic import CriticTrainer
from miles.backends.training_utils.step.micro_batches import MicroBatcher
from miles.backends.training_utils.step.train_engine import TrainEngine, TrainsAdapters
from miles.backends.training_utils.step.trainer import PolicyTrainer
from miles.config.lora_args import LORA_ADAPTER_NAME, LoraArgs
from miles.config.trainer_args import TrainerArgs
from miles.train_backend.run_spec import TrainRunSpec
from miles.utils.checkpoint_layout import commit_checkpoint
from miles.utils.loopback import is_loopback

logger = logging.getLogger(__name__)

Role = Literal["actor", "critic"]
ROLES: tuple[str, ...] = ("actor", "critic")

# How long a rank waits in init_process_group for the others (slow first imports on big clusters).
DEFAULT_TIMEOUT_S = 1800.0


class TrainRayActor(abc.ABC):
    """One rank of a training group.

    Every rank of the group receives the same calls, in the same order: most of them run
    collectives, so a call made on some ranks only hangs. `data_ref` in `train` is this rank's
    data-parallel shard (a columnar `RolloutBatch`; Ray resolves a top-level ObjectRef to it).
    """

    backend_name: ClassVar[str] = "backend"
    """Names the weight-update group with the engines (`miles-<name>-weights`)."""
    weights_group_suffix: str = ""
    """Ends the weight-update group's name: a restarted train group's own (see `rejoin`)."""

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
        self._store_socket: socket.socket | None = None  # rank 0 on loopback: the store's
        self.master_port = int(master_port)
        self.engine: TrainEngine | None = None
        self.critic_engine: TrainEngine | None = None  # --advantage-estimator ppo
        self.trainer: PolicyTrainer | None = None
        # Role "critic" (a critic on ranks of its own): its step; no policy on these ranks.
        self.critic_trainer: CriticTrainer | None = None
        self.weight_version = 0
        self.engine_urls: tuple[str, ...] = ()
        self._engine_admin_key: str | None = None
        self._updater: WeightUpdater | None = None
        self._lora_sync_dir: str | None = None  # rank 0, --lora-sync adapter
        self._asleep = False

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
        timeout = datetime.timedelta(seconds=timeout_s)
        if not is_loopback(self.master_addr):
            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://{_host_for_url(self.master_addr)}:{self.master_port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timeout,
            )
            return
        dist.init_process_group(
            backend=backend, store=self._loopback_store(timeout), rank=self.rank,
            world_size=self.world_size, timeout=timeout,
        )  # fmt: skip

    def _loopback_store(self, timeout: datetime.timedelta) -> dist.TCPStore:
        """The rendezvous store of a run on one node, listening on loopback only: torch's own
        TCPStore server binds every interface, so rank 0 hands it a socket bound here."""
        host = self.master_addr
        if self.rank != 0:
            return dist.TCPStore(host, self.master_port, self.world_size, False, timeout)
        self._store_socket = socket.create_server((host, self.master_port), backlog=128)
        return dist.TCPStore(
            host, self.master_port, self.world_size, True, timeout,
            master_listen_fd=self._store_socket.fileno(),
        )  # fmt: skip

    # -- what a backend implements ------------------------------------------------------------

    def check_supported(self, backend: TrainerArgs) -> None:
        """Refuse, naming the flag, what this backend cannot do on this machine; called in
        `init` before the process group forms. A backend that can run anywhere has no checks."""
        logger.debug("the %s backend runs on any device", self.backend_name)

    def build_critic_engine(
        self, spec: TrainRunSpec, backend: TrainerArgs, *, device: torch.device
    ) -> TrainEngine:
        """PPO's value model on this rank (--advantage-estimator ppo): a `TrainEngine` whose
        log-probs are values (see `CriticTrainer`), built from `spec.hf_checkpoint` with
        `backend`'s optimizer settings. A backend that trains no critic keeps this refusal."""
        raise ValueError(
            f"the {self.backend_name} backend trains no critic (--advantage-estimator ppo); use "
            "--train-backend fsdp"
        )

    @abc.abstractmethod
    def build_engine(
        self, spec: TrainRunSpec, backend: TrainerArgs, *, device: torch.device, with_ref: bool
    ) -> TrainEngine:
        """Build model, optimizer, schedule and parallel groups on `device` (the process group
        is joined); `with_ref` asks for a frozen reference model too."""

    # -- the contract the loop calls ----------------------------------------------------------

    def init(
        self,
        spec: TrainRunSpec,
        loss: LossConfig,
        backend: TrainerArgs,
        *,
        role: Role = "actor",
        with_ref: bool = False,
    ) -> int:
        """Build the engine and the train step, resume from `spec.load` if it holds a checkpoint.
        Role "actor": the policy (and the critic, unless it has ranks of its own); role
        "critic": only the critic of --critic-num-nodes / --critic-num-gpus-per-node.

        Returns the rollout id to start from: 0 for a fresh run, the saved id + 1 on resume.
        """
        algorithm = Algorithm.from_config(loss)
        if role not in ROLES:
            raise ValueError(f"a train actor's role is one of {ROLES}, got {role!r}")
        if role == "critic":
            return self._init_critic(spec, loss, backend)
        if algorithm.estimator.needs_critic and spec.critic is None:
            raise ValueError(
                f"--advantage-estimator {loss.advantage_estimator} reads a critic's values, but "
                "the run spec has no critic (TrainRunSpec.critic)"
            )
        PolicyTrainer.check_settings(loss, use_rollout_logprobs=backend.use_rollout_logprobs)
        device = self._join(spec, backend)
        self.engine = self.build_engine(
            spec, backend, device=device, with_ref=with_ref or algorithm.needs_reference
        )
        critic_on_own_ranks = spec.critic is not None and spec.critic.on_own_ranks
        if spec.critic is not None and not critic_on_own_ranks:
            self.critic_engine = self.build_critic_engine(
                critic_run_spec(spec, spec.critic), critic_settings(backend, spec.critic),
                device=device,
            )  # fmt: skip
        self.trainer = PolicyTrainer(
            self.engine,
            loss,
            global_batch_size=spec.global_batch_size,
            **_micro_batching(backend),
            use_rollout_logprobs=backend.use_rollout_logprobs,
            distillation=spec.distillation,
            critic=self.critic_engine,
            critic_on_own_ranks=critic_on_own_ranks,
        )
        return self._resume()

    def _init_critic(self, spec: TrainRunSpec, loss: LossConfig, backend: TrainerArgs) -> int:
        """Role "critic": the value model alone on these ranks, resumed from --critic-load."""
        critic = spec.critic
        if critic is None or not critic.on_own_ranks:
            raise ValueError(
                "role 'critic' is a critic on ranks of its own (--critic-num-nodes / "
                "--critic-num-gpus-per-node with --advantage-estimator ppo); the run spec has "
                + ("no critic" if critic is None else "a critic on the policy's ranks")
            )
        device = self._join(spec, backend)
        settings = critic_settings(backend, critic)
        self.critic_engine = self.build_critic_engine(
            critic_run_spec(spec, critic), settings, device=device
        )
        self.critic_trainer = CriticTrainer(
            self.critic_engine,
            loss,
            global_batch_size=spec.global_batch_size,
            micro_batches=MicroBatcher(self.critic_engine, **_micro_batching(settings)),
        )
        loaded = self.critic_engine.load(critic.critic_load) if critic.critic_load else None
        if loaded is None:
            return 0
        self.critic_trainer.global_step = int(loaded.extra.get("global_step", 0))
        logger.info("critic rank %d resumed rollout %d from %s",
                    self.rank, loaded.rollout_id, critic.critic_load)  # fmt: skip
        return loaded.rollout_id + 1

    def _join(self, spec: TrainRunSpec, backend: TrainerArgs) -> torch.device:
        """What every rank does before building its engines: refuse what the backend cannot
        do here, take its device, join the process group, seed; returns the device."""
        self.check_supported(backend)
        # The device first: NCCL binds a communicator to the device current at its creation.
        device = set_device(self.local_rank)
        self.setup_distributed(spec.distributed_timeout_s)
        torch.manual_seed(backend.seed)
        self.spec, self.backend = spec, backend
        return device

    def _resume(self) -> int:
        assert self.engine is not None and self.trainer is not None
        if not self.spec.load:
            return 0
        loaded = self.engine.load(self.spec.load)
        if loaded is None:
            logger.info("no checkpoint in --load %s; starting at rollout 0", self.spec.load)
            return 0
        self.weight_version = int(loaded.extra.get("weight_version", 0))
        self.trainer.global_step = int(loaded.extra.get("global_step", 0))
        self._resume_critic(loaded.rollout_id)
        logger.info("resumed rollout %d from %s", loaded.rollout_id, self.spec.load)
        return loaded.rollout_id + 1

    def _resume_critic(self, rollout_id: int) -> None:
        """The critic resumes at the policy's rollout, or the run cannot go on exactly."""
        critic = self.spec.critic
        if critic is None or self.critic_engine is None or self.trainer.critic is None:
            return
        loaded = self.critic_engine.load(critic.critic_load) if critic.critic_load else None
        if loaded is None or loaded.rollout_id != rollout_id:
            found = "no checkpoint" if loaded is None else f"rollout {loaded.rollout_id}"
            raise ValueError(
                f"the policy resumes after rollout {rollout_id} from {self.spec.load}, but the "
                f"critic's --critic-load {critic.critic_load} holds {found}; point --critic-load "
                "at the critic saved with that policy checkpoint"
            )
        self.trainer.critic.global_step = int(loaded.extra.get("global_step", 0))

    def data_parallel_rank(self) -> int:
        """Which data-parallel shard of each rollout this rank trains on (valid after `init`).

        Ranks that split one model replica (tensor / pipeline / context-parallel peers) see the
        same samples, so they share a shard."""
        if self.engine is not None:
            return self.engine.dp_rank
        return self.critic_engine.dp_rank if self.critic_engine is not None else self.rank

    def train(self, rollout_id: int, data_ref: Any) -> list[dict[str, float]]:
        """Take this rollout's optimizer steps on this rank's shard; each step's metrics."""
        return self._train(rollout_id, _resolve(data_ref))

    def train_with_values(
        self, rollout_id: int, data_ref: Any, values: list[torch.Tensor]
    ) -> tuple[list[dict[str, float]], list[torch.Tensor]]:
        """`train` with the values of a critic on ranks of its own (its `critic_values` for
        this shard); also returns GAE's returns of the shard, which that critic trains on."""
        batch = _resolve(data_ref)
        batch["values"] = values
        metrics = self._train(rollout_id, batch)
        return metrics, batch["returns"]

    def _train(self, rollout_id: int, batch: RolloutBatch) -> list[dict[str, float]]:
        self._require_awake("train")
        logger.info("rank %d: training rollout %d", self.rank, rollout_id)
        trainer = self._trainer
        critic = self.spec.critic
        # --num-critic-only-steps: the first rollouts fit the critic to the policy as it is.
        train_policy = critic is None or rollout_id >= critic.num_critic_only_steps
        metrics = trainer.train(batch, train_policy=train_policy)
        interval = self.spec.ref_update_interval
        if interval is not None and (rollout_id + 1) % interval == 0:
            # --ref-update-interval: the KL now anchors to the policy of this rollout's end.
            self._engine.update_reference()
            logger.info("rank %d: reference model set to the policy after rollout %d",
                        self.rank, rollout_id)  # fmt: skip
        return metrics

    # -- a critic on ranks of its own (role "critic") -----------------------------------------

    def critic_values(self, data_ref: Any) -> list[torch.Tensor]:
        """The critic's (R,) values of each response in this rank's shard, before any step."""
        return self._critic_trainer.values(_resolve(data_ref))

    def train_critic(
        self,
        rollout_id: int,
        data_ref: Any,
        values: list[torch.Tensor],
        returns: list[torch.Tensor],
    ) -> list[dict[str, float]]:
        """The critic's optimizer steps on this shard, with the `values` it gave and the
        policy's GAE `returns` (`train_with_values`); each step's `critic/...` metrics."""
        logger.info("critic rank %d: training rollout %d", self.rank, rollout_id)
        batch = _resolve(data_ref)
        batch["values"], batch["returns"] = values, returns
        return self._critic_trainer.train(batch)

    def logprob_gap(self, data_ref: Any) -> float:
        """The step-0 check (architecture.md: "The loop"): mean |trainer - engine| log-prob over
        the trainable response tokens of every rank's shard."""
        self._require_awake("logprob_gap")
        return self._trainer.logprob_gap(_resolve(data_ref))

    def save_model(
        self, rollout_id: int, commit: bool = True, weight_version: int | None = None
    ) -> None:
        """A resumable checkpoint of model, optimizer and schedule for `rollout_id`; without
        `commit` it is not named the latest until `commit_checkpoint`. `weight_version`: the
        version to record, when not the current one (a save after this rollout's weight push
        records the version of its save point, so a resumed run numbers its pushes the same)."""
        if self.critic_trainer is not None:  # role "critic"
            self._save_critic(rollout_id, self.critic_trainer.global_step, commit=commit)
            return
        if not self.spec.save:
            raise ValueError("save_model() needs a checkpoint directory: set --save")
        self._require_awake("save_model")
        extra = {
            "weight_version": self.weight_version if weight_version is None else weight_version,
            "global_step": self._trainer.global_step,
            "hf_checkpoint": str(self.spec.hf_checkpoint),
        }
        self._engine.save(self.spec.save, rollout_id, extra, commit=commit)
        if self._trainer.critic is not None:
            self._save_critic(rollout_id, self._trainer.critic.global_step, commit=commit)

    def _save_critic(self, rollout_id: int, global_step: int, *, commit: bool) -> None:
        critic = self.spec.critic
        if critic is None or self.critic_engine is None or not critic.critic_save:
            return
        extra = {
            "global_step": global_step,
            "hf_checkpoint": str(critic.critic_hf_checkpoint or self.spec.hf_checkpoint),
        }
        self.critic_engine.save(critic.critic_save, rollout_id, extra, commit=commit)

    def commit_checkpoint(self, rollout_id: int) -> None:
        """Name `rollout_id`'s checkpoint (saved with commit=False) the latest; rank 0 writes.
        The critic's is committed by the ranks that hold it."""
        if self.rank != 0:
            return
        if self.engine is not None and self.spec.save:
            commit_checkpoint(self.spec.save, rollout_id)
        critic = self.spec.critic
        if critic is not None and critic.critic_save and self.critic_engine is not None:
            commit_checkpoint(critic.critic_save, rollout_id)

    def export_hf(self, path: str | Path) -> None:
        """The current weights as a Hugging Face checkpoint directory."""
        self._require_awake("export_hf")
        self._engine.export_hf(path)

    def connect_engines(self, engine_urls: list[str], admin_api_key: str | None = None) -> None:
        """The rollout engines the weights are pushed to, and their admin key. The loop starts
        the engines beside the trainers and calls this once they answer, before the first
        weight update."""
        try:
            self.close()  # a new set of engines needs a new weight-update group
        except Exception:  # an engine of the old group is gone (a lost external engine)
            logger.warning("rank %d: leaving the old weight-update group", self.rank,
                           exc_info=True)  # fmt: skip
            self._updater = None
        self.engine_urls = tuple(engine_urls)
        self._engine_admin_key = admin_api_key

    def update_weights(self) -> int:
        """Push the weights to every engine as the next weight version (all ranks call this);
        returns that version."""
        if not self.engine_urls:
            raise ValueError(
                "update_weights() has no engine to update: connect_engines() was not called "
                "with any URL (replayed rollouts, or engines that did not start)"
            )
        if self._updater is None:
            self._updater = self._make_updater()
        self.weight_version += 1
        self._push(self._updater)
        return self.weight_version

    def rejoin(self, weight_version: int | None, generation: int) -> None:
        """In a train group started again after one of its ranks died (all ranks call this,
        after `init` and the replay): count weight versions on from `weight_version`, the one
        the engines hold (None: the checkpoint's), and name this group's weight-update group by
        its `generation`, since the engines still hold the dead group's under the old name."""
        if weight_version is not None:
            self.weight_version = weight_version
        self.weights_group_suffix = f"-restart{generation}"

    def restore_engines(self, engine_urls: list[str]) -> int:
        """Push the current weights, as the current version, to restarted engines (all ranks
        call this); returns that version. The other engines keep generating undisturbed, and
        the next `update_weights` forms a new weight-update group with every engine (the old
        one still counts the engines' former processes)."""
        unknown = sorted(set(engine_urls) - set(self.engine_urls))
        if unknown:
            raise ValueError(f"restore_engines(): {unknown} are not among {self.engine_urls}")
        if self._updater is not None:
            try:
                self._updater.shutdown()
            except Exception:  # the group still names the dead engine: it may not answer
                logger.warning("rank %d: leaving the old weight-update group", self.rank,
                               exc_info=True)  # fmt: skip
            self._updater = None
        updater = self._make_updater(only=engine_urls, group_suffix="-restore")
        try:
            self._push(updater)
        finally:
            updater.shutdown()
        return self.weight_version

    def _make_updater(self, only: list[str] | None = None, group_suffix: str = "") -> WeightUpdater:
        engine = self._engine
        if self.backend.uses_lora and self.backend.lora_sync == "adapter":
            return self._make_adapter_updater(only)
        return make_weight_updater(
            engine.named_weights, engine_urls=list(self.engine_urls), rank=self.rank,
            world_size=self.world_size, colocate=self.spec.colocate,
            buffer_size=self.backend.update_weight_buffer_size, dtype=engine.engine_dtype,
            master_address=self.master_addr,
            group_name=f"miles-{self.backend_name}-weights{self.weights_group_suffix}{group_suffix}",
            only=only,
            timeout_s=self.spec.distributed_timeout_s, api_key=self._engine_admin_key,
            http_timeouts=EngineTimeouts(
                control_s=self.spec.engine_control_timeout_s,
                weights_s=self.spec.update_weights_timeout_s,
            ),
        )  # fmt: skip

    def _make_adapter_updater(self, only: list[str] | None) -> WeightUpdater:
        """--lora-sync adapter: rank 0 writes each adapter version where the engines read it
        and has them load it; every rank gathers the adapter."""
        engine = self._engine
        if not isinstance(engine, TrainsAdapters):
            raise ValueError(
                f"--lora-sync adapter: the {self.backend_name} backend cannot hand over its "
                "LoRA adapters; use --lora-sync merged"
            )
        if self.rank == 0 and self._lora_sync_dir is None:
            self._lora_sync_dir = self.backend.lora_sync_dir or tempfile.mkdtemp(
                prefix="miles-lora-"
            )
        return make_lora_adapter_updater(
            engine.adapter_weights, engine.adapter_config(), engine_urls=list(self.engine_urls),
            rank=self.rank, world_size=self.world_size, sync_dir=self._lora_sync_dir or "",
            adapter_name=LORA_ADAPTER_NAME, only=only, api_key=self._engine_admin_key,
            http_timeouts=EngineTimeouts(
                control_s=self.spec.engine_control_timeout_s,
                weights_s=self.spec.update_weights_timeout_s,
            ),
        )  # fmt: skip

    def _push(self, updater: WeightUpdater) -> None:
        # Colocated, the loop pushes weights while the trainer sleeps (the engines hold the
        # device then); the engine keeps them readable for the push.
        with self._engine.weights_on_device():
            updater.update(str(self.weight_version))

    def sleep(self) -> None:
        """Free device memory for colocated engines; a no-op while asleep."""
        if not self._asleep:
            if self.engine is not None:
                self.engine.sleep()
            if self.critic_engine is not None:
                self.critic_engine.sleep()
            self._asleep = True

    def wake_up(self) -> None:
        """Bring back what `sleep` moved; a no-op while awake (the loop wakes the trainer before
        every train step, also the first)."""
        if self._asleep:
            if self.engine is not None:
                self.engine.wake_up()
            if self.critic_engine is not None:
                self.critic_engine.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Leave the engines' weight-update group (disaggregated) and close engine clients.

        The process group stays: a rank may re-create its engine connections after `close`.
        """
        if self._updater is not None:
            self._updater.shutdown()
            self._updater = None

    # -- helpers ------------------------------------------------------------------------------

    @property
    def _engine(self) -> TrainEngine:
        if self.engine is None:
            raise RuntimeError("the train actor is not initialized: call init() first")
        return self.engine

    @property
    def _critic_trainer(self) -> CriticTrainer:
        if self.critic_trainer is None:
            raise RuntimeError(
                "critic_values / train_critic run on the ranks of a critic of its own: init() "
                "them with role 'critic'"
            )
        return self.critic_trainer

    @property
    def _trainer(self) -> PolicyTrainer:
        if self.trainer is None:
            raise RuntimeError("the train actor is not initialized: call init() first")
        return self.trainer

    def _require_awake(self, call: str) -> None:
        # A sleeping engine's state may have no device memory behind it.
        if self._asleep:
            raise RuntimeError(f"{call}() while the trainer sleeps: call wake_up() first")


def _resolve(data_ref: Any) -> RolloutBatch:
    # Ray hands an actor method the value behind a top-level ObjectRef argument, so a rank's
    # shard arrives here as the RolloutBatch itself.
    if isinstance(data_ref, dict):
        return data_ref
    raise TypeError(
        f"train() got data of type {type(data_ref).__name__}; pass this rank's RolloutBatch "
        "(a dict of per-sample lists), or its ray.ObjectRef as a top-level argument"
    )


def _host_for_url(address: str) -> str:
    # An IPv6 literal needs brackets inside a tcp:// URL.
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def _micro_batching(settings: TrainerArgs) -> dict[str, int | None]:
    """Fixed micro-batches of --micro-batch-size, or dynamic ones of --max-tokens-per-gpu."""
    dynamic = settings.use_dynamic_batch_size
    return {
        "micro_batch_size": None if dynamic else settings.micro_batch_size,
        "max_tokens_per_gpu": settings.max_tokens_per_gpu if dynamic else None,
    }


def critic_run_spec(spec: TrainRunSpec, critic: CriticConfig) -> TrainRunSpec:
    """The run as the critic's engine sees it: its own start checkpoint and directories, no
    reference model, teacher or routing replay (a value model has none of them)."""
    return dataclasses.replace(
        spec, hf_checkpoint=critic.critic_hf_checkpoint or spec.hf_checkpoint,
        save=critic.critic_save, load=critic.critic_load, ref_load=None,
        ref_update_interval=None, distillation=None, routing_replay=None, critic=None,
    )  # fmt: skip


def critic_settings(backend: TrainerArgs, critic: CriticConfig) -> TrainerArgs:
    """The policy's optimizer and schedule settings with the critic's learning rate and warmup;
    the critic trains every weight (the policy's LoRA settings are its own)."""
    lr = backend.lr if critic.critic_lr is None else critic.critic_lr
    warmup = backend.lr_warmup_iters
    if critic.critic_lr_warmup_iters is not None:
        warmup = critic.critic_lr_warmup_iters
    no_lora = {f.name: f.default for f in dataclasses.fields(LoraArgs)}
    return dataclasses.replace(
        backend, lr=lr, lr_warmup_iters=warmup, min_lr=min(backend.min_lr, lr), **no_lora
    )
