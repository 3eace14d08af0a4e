"""`MilesConfig`, the whole configuration of a run, and how it is built from the settings' values.

Sources, later wins: dataclass defaults < the YAML file of `--config` < command-line flags (read by
`loader`). Building it writes the values derived from others (`derivation`: the batch identity of
architecture.md: "Contracts / Data", the engines' devices, ...), runs the checks across groups
(`cross_checks`), resolves the paths (`paths`) and builds the evaluation datasets (`eval_datasets`),
in that order; nothing else writes them (but the run length from --num-epoch, which waits for the
dataset). Nothing here imports Ray.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from miles.backends.training_utils.algorithms.algorithm import Algorithm
from miles.backends.training_utils.algorithms.critic_config import CriticConfig
from miles.backends.training_utils.algorithms.distillation import DistillationConfig
from miles.backends.training_utils.algorithms.loss_config import LossConfig
from miles.config import cross_checks, derivation, external_engines, paths
from miles.config.eval_config import EvalConfig
from miles.config.eval_datasets import build_eval_datasets
from miles.config.groups import (
    CheckpointConfig,
    ClusterConfig,
    EngineConfig,
    LoggingConfig,
    TrainingConfig,
)
from miles.config.registry import Schema
from miles.config.trainer_args import TrainerArgs
from miles.rollout.data_source import DataSourceConfig
from miles.rollout.rewards import RewardConfig
from miles.rollout.rollout_config import RolloutConfig
from miles.utils.observability.config import ObservabilityConfig


@dataclass(kw_only=True)
class MilesConfig:
    """A validated run configuration: one instance of each group, derived values filled in."""

    cluster: ClusterConfig
    engine: EngineConfig
    data: DataSourceConfig
    rollout: RolloutConfig
    reward: RewardConfig
    algorithm: LossConfig
    distillation: DistillationConfig
    critic: CriticConfig
    training: TrainingConfig
    checkpoint: CheckpointConfig
    eval: EvalConfig
    logging: LoggingConfig
    observability: ObservabilityConfig = dataclasses.field(default_factory=ObservabilityConfig)
    """MLflow, Prometheus, profiling and memory records (off by default)."""
    backend: TrainerArgs | None = None
    """The backend's settings (e.g. FSDPArgs); None only for a schema without a backend."""

    @property
    def model_parallel_size(self) -> int:
        """Train ranks one model replica takes (tensor x pipeline x context parallel sizes)."""
        return 1 if self.backend is None else self.backend.model_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """Model replicas among the train ranks: how many shards each rollout is split into."""
        return self.cluster.actor_world_size // self.model_parallel_size

    def __post_init__(self) -> None:
        # The checks read derived values; the paths come last so that the errors before name
        # them as the user wrote them. The order of the checks decides which error a config
        # with several mistakes reports.
        self._derive()
        self._check_across_groups()
        self._resolve_paths()
        # Last: each dataset's data settings are a copy of the run's, paths resolved.
        self.eval.eval_datasets = build_eval_datasets(
            self.eval, rollout=self.rollout, data=self.data, reward=self.reward
        )
        for data in (self.data, *(d.data for d in self.eval.eval_datasets)):
            cross_checks.check_images(data, self.checkpoint.hf_checkpoint)

    def _derive(self) -> None:
        """Write the values `derivation` computes (of them, only the batch identity can refuse)."""
        cluster, training, rollout = self.cluster, self.training, self.rollout
        batch = derivation.batch_identity(rollout, training)
        training.global_batch_size, training.num_steps_per_rollout = batch
        cluster.rollout_num_gpus = derivation.rollout_num_gpus(cluster)
        training.fully_async_buffer_groups = derivation.fully_async_buffer_groups(training, rollout)
        rollout.return_routed_experts = derivation.return_routed_experts(training, rollout)
        self.checkpoint.load = derivation.load_dir(self.checkpoint)
        trains_critic = Algorithm.from_config(self.algorithm).estimator.needs_critic
        self.critic.critic_save = derivation.critic_save_dir(
            self.critic, self.checkpoint, trains_critic=trains_critic
        )
        self.critic.critic_load = self.critic.critic_load or self.critic.critic_save

    def _check_across_groups(self) -> None:
        """Every combination of settings that cannot work, or that would silently do nothing."""
        cluster, training, rollout, checkpoint = (
            self.cluster, self.training, self.rollout, self.checkpoint
        )  # fmt: skip
        cross_checks.check_placement(cluster, self.distillation, self.critic)
        external_engines.check_settings(
            cluster, self.engine, training, rollout, self.distillation, self.backend
        )
        made = cross_checks.load_run_rollout(rollout)
        cross_checks.check_rollout(made, rollout, self.data)
        cross_checks.check_async_modes(cluster, training, rollout, self.algorithm, made)
        cross_checks.check_reference_model(self.algorithm, checkpoint)
        cross_checks.check_lora(self.backend, checkpoint)
        cross_checks.check_critic(self.critic, self.algorithm, self.backend, cluster)
        cross_checks.check_distillation(self.distillation, self.algorithm, checkpoint, training)
        cross_checks.check_routing_replay(training, rollout, checkpoint, cluster, made)
        cross_checks.check_fault_tolerance(self.engine, cluster)
        cross_checks.check_labels(self.reward, self.data)
        cross_checks.check_mixture(self.reward, self.data)
        cross_checks.check_observability(self.observability, training)
        cross_checks.check_parallel_sizes(
            cluster, training, model_parallel_size=self.model_parallel_size
        )

    def _resolve_paths(self) -> None:
        """Relative paths resolved against the launch directory: Ray workers run elsewhere."""
        checkpoint, training, logging_ = self.checkpoint, self.training, self.logging
        paths.check_hf_checkpoint(checkpoint.hf_checkpoint)
        checkpoint.hf_checkpoint = paths.hf_checkpoint_path(checkpoint.hf_checkpoint)
        checkpoint.save = paths.absolute(checkpoint.save)
        checkpoint.load = paths.absolute(checkpoint.load)
        checkpoint.ref_load = paths.absolute(checkpoint.ref_load)
        for name in ("critic_hf_checkpoint", "critic_load", "critic_save"):
            setattr(self.critic, name, paths.absolute(getattr(self.critic, name)))
        self.data.prompt_data = paths.absolute(self.data.prompt_data)
        self.data.chat_template_path = paths.absolute(self.data.chat_template_path)
        self.eval.eval_prompt_data = paths.eval_prompt_paths(self.eval.eval_prompt_data)
        self.eval.eval_config = paths.absolute(self.eval.eval_config)
        logging_.output_dir = paths.absolute(logging_.output_dir)
        self.engine.engine_log_dir = paths.absolute(self.engine.engine_log_dir)
        training.save_debug_rollout_data = paths.absolute(training.save_debug_rollout_data)
        training.load_debug_rollout_data = paths.absolute(training.load_debug_rollout_data)
        observability = self.observability
        observability.memory_snapshot_dir = paths.absolute(observability.memory_snapshot_dir)
        if self.backend is not None:
            self.backend.lora_adapter_path = paths.absolute(self.backend.lora_adapter_path)
            self.backend.lora_sync_dir = paths.absolute(self.backend.lora_sync_dir)
            # The backend's own settings against the model, before anything starts.
            self.backend.check_checkpoint(checkpoint.hf_checkpoint)
        cross_checks.check_critic_vocabulary(self.critic, checkpoint.hf_checkpoint)

    @classmethod
    def from_values(cls, schema: Schema, values: dict[str, Any]) -> MilesConfig:
        """Build every group from flat `values` (name -> converted value); missing -> defaults."""
        missing = [o.flag for o in schema.options.values() if o.required and o.name not in values]
        if missing:
            raise ValueError(
                f"missing required setting(s) {', '.join(missing)}; pass them as flags or in the "
                "--config YAML file"
            )
        groups = {}
        for group, group_cls in schema.groups.items():
            names = {f.name for f in dataclasses.fields(group_cls) if f.init}
            groups[group] = group_cls(**{k: v for k, v in values.items() if k in names})
        return cls(**groups)

    def value(self, name: str) -> Any:
        """The value of setting `name`, from whichever group holds it."""
        for group in self.groups().values():
            if group is not None and name in {f.name for f in dataclasses.fields(group)}:
                return getattr(group, name)
        raise KeyError(name)

    def groups(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def flat(self) -> dict[str, Any]:
        """Every setting by name (what `miles train` records as the run's config)."""
        values: dict[str, Any] = {}
        for group in self.groups().values():
            if group is not None:
                values.update(dataclasses.asdict(group))
        return values

    @property
    def ray_address(self) -> str | None:
        return self.cluster.ray_address or os.environ.get("RAY_ADDRESS") or None

    def resolve_num_rollout(self, dataset_size: int) -> int:
        """--num-rollout, or the rollouts that cover --num-epoch passes over the prompts."""
        from miles.rollout.data_source import num_rollouts_for_epochs

        training = self.training
        if training.num_rollout is None:
            epochs = training.num_epoch or 1
            training.num_rollout = num_rollouts_for_epochs(
                epochs, dataset_size, self.rollout.rollout_batch_size
            )
        return training.num_rollout
