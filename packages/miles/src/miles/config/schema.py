"""The whole configuration of a run: every group, how they are merged, and the checks across them.

Sources, later wins: dataclass defaults < the YAML file of `--config` < command-line flags. The
training backend's group comes from the backend's wheel (the class registered under
`miles.train_backend_args`; the actor is not imported), so its flags exist exactly when that backend
is chosen. Values derived from others (the batch identity of architecture.md: "Contracts / Data",
the run length from epochs) are computed here and only here. Nothing here imports Ray.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.backends.training_utils.checkpoint_paths import hf_checkpoint_dir
from miles.backends.training_utils.distillation import DistillationConfig
from miles.backends.training_utils.loss_config import LossConfig
from miles.config.groups import (
    CheckpointConfig,
    ClusterConfig,
    EngineConfig,
    EvalConfig,
    LoggingConfig,
    TrainingConfig,
)
from miles.config.options import Option, dataclass_options
from miles.config.trainer_args import TrainerArgs
from miles.ray.placement_plan import plan_for_run
from miles.rollout.data_source import DataSourceConfig
from miles.rollout.rewards import RewardConfig
from miles.rollout.rewards.config import BUILTIN_RM_TYPES
from miles.rollout.rollout_config import RolloutConfig
from miles.utils.plugins import TRAIN_BACKEND_ARGS, load_plugin

CORE_GROUPS: dict[str, type] = {
    "cluster": ClusterConfig,
    "engine": EngineConfig,
    "data": DataSourceConfig,
    "rollout": RolloutConfig,
    "reward": RewardConfig,
    "algorithm": LossConfig,
    "distillation": DistillationConfig,
    "training": TrainingConfig,
    "checkpoint": CheckpointConfig,
    "eval": EvalConfig,
    "logging": LoggingConfig,
}
"""Group name -> dataclass, in the order of `--help` and the generated reference."""

BACKEND_GROUP = "backend"


def backend_config_class(train_backend: str) -> type[TrainerArgs]:
    """The settings dataclass the backend's wheel registers (a `TrainerArgs` subclass)."""
    config_class = load_plugin(TRAIN_BACKEND_ARGS, train_backend)
    if not (isinstance(config_class, type) and issubclass(config_class, TrainerArgs)):
        raise TypeError(
            f"the {TRAIN_BACKEND_ARGS} entry point {train_backend!r} names {config_class!r}, "
            "not a TrainerArgs subclass; the backend's wheel must register its settings class"
        )
    return config_class


@dataclass
class Schema:
    """Every option of a run with the groups it configures (core groups, then the backend's)."""

    groups: dict[str, type]
    options: dict[str, Option] = field(init=False)

    def __post_init__(self) -> None:
        self.options = {}
        for group, cls in self.groups.items():
            for option in dataclass_options(cls, group):
                self.options[option.name] = self._merge(option)

    def _merge(self, option: Option) -> Option:
        known = self.options.get(option.name)
        if known is None:
            return option
        # One name in two groups is one setting: it must mean the same thing in both.
        assert known.annotation == option.annotation and known.default == option.default, (
            f"{option.flag} is declared by groups {known.groups} and {option.groups} with "
            f"different types or defaults ({known.annotation}={known.default!r} vs "
            f"{option.annotation}={option.default!r}); make them agree"
        )
        return dataclasses.replace(
            known, groups=known.groups + option.groups, doc=known.doc or option.doc
        )

    @classmethod
    def for_backend(cls, train_backend: str | None) -> Schema:
        groups = dict(CORE_GROUPS)
        if train_backend:
            groups[BACKEND_GROUP] = backend_config_class(train_backend)
        return cls(groups)

    def unknown(self, name: str, where: str) -> ValueError:
        """An error for an unknown setting, suggesting the closest known one."""
        as_flag = name.startswith("--")
        known = [o.flag if as_flag else o.name for o in self.options.values()]
        key = name if as_flag else name.replace("-", "_")
        match = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"; did you mean {match[0]!r}?" if match else "; see `miles train --help`"
        return ValueError(f"unknown setting {name!r} in {where}{hint}")


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
    training: TrainingConfig
    checkpoint: CheckpointConfig
    eval: EvalConfig
    logging: LoggingConfig
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
        _derive_batch_identity(self)
        _check_across_groups(self)
        _absolute_paths(self)

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


# What Hugging Face accepts as a repository id: "name" or "org/name", no leading dot.
_HUB_ID = re.compile(r"[\w-][\w.-]*(/[\w-][\w.-]*)?")


def _absolute_paths(config: MilesConfig) -> None:
    """Relative paths resolved against the launch directory: Ray workers run elsewhere."""

    def absolute(path: str | None) -> str | None:
        return None if path is None else os.path.abspath(os.path.expanduser(path))

    checkpoint, training, logging_ = config.checkpoint, config.training, config.logging
    if os.path.exists(os.path.expanduser(checkpoint.hf_checkpoint)):
        checkpoint.hf_checkpoint = absolute(checkpoint.hf_checkpoint)
    elif not _HUB_ID.fullmatch(checkpoint.hf_checkpoint):
        # A hub id ("Qwen/Qwen3-0.6B") is resolved by transformers; anything else is a path,
        # and a missing one would otherwise fail as a malformed hub id after the start-up.
        raise ValueError(
            f"--hf-checkpoint {checkpoint.hf_checkpoint}: no such directory; pass an existing "
            "Hugging Face checkpoint directory or a hub id (org/name)"
        )
    checkpoint.save, checkpoint.load = absolute(checkpoint.save), absolute(checkpoint.load)
    config.data.prompt_data = absolute(config.data.prompt_data)
    config.data.chat_template_path = absolute(config.data.chat_template_path)
    if config.eval.eval_prompt_data:
        pairs = config.eval.eval_prompt_data
        config.eval.eval_prompt_data = [
            item if i % 2 == 0 else absolute(item) for i, item in enumerate(pairs)
        ]
    logging_.output_dir = absolute(logging_.output_dir)
    config.engine.engine_log_dir = absolute(config.engine.engine_log_dir)
    training.save_debug_rollout_data = absolute(training.save_debug_rollout_data)
    training.load_debug_rollout_data = absolute(training.load_debug_rollout_data)


def _derive_batch_identity(config: MilesConfig) -> None:
    """rollout_batch_size * n_samples_per_prompt == global_batch_size * num_steps_per_rollout
    (architecture.md: "Contracts / Data"); the missing side is derived, a given pair must agree."""
    rollout, training = config.rollout, config.training
    samples = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    where = (
        f"--rollout-batch-size ({rollout.rollout_batch_size}) x --n-samples-per-prompt "
        f"({rollout.n_samples_per_prompt}) = {samples} samples per rollout"
    )
    gbs, steps = training.global_batch_size, training.num_steps_per_rollout
    if gbs is None and steps is None:
        steps = 1
    if gbs is None:
        assert steps is not None
        if samples % steps:
            raise ValueError(
                f"{where} cannot be split into --num-steps-per-rollout ({steps}) equal steps; "
                f"use a divisor of {samples}"
            )
        gbs = samples // steps
    elif steps is None:
        if samples % gbs:
            raise ValueError(
                f"{where} is not a multiple of --global-batch-size ({gbs}); use a divisor of "
                f"{samples}"
            )
        steps = samples // gbs
    elif gbs * steps != samples:
        raise ValueError(
            f"{where}, but --global-batch-size ({gbs}) x --num-steps-per-rollout ({steps}) = "
            f"{gbs * steps}; give only one of the two and miles derives the other"
        )
    training.global_batch_size, training.num_steps_per_rollout = gbs, steps


def _check_async_modes(config: MilesConfig) -> None:
    """--async-train, --fully-async and --update-weights-interval: each trains on samples of
    older weights than the trainer's."""
    cluster, training, rollout = config.cluster, config.training, config.rollout
    correction = config.algorithm.off_policy_correction
    for flag, used in (("--async-train", training.async_train),
                       ("--fully-async", training.fully_async),
                       ("--update-weights-interval above 1", training.update_weights_interval > 1)):  # fmt: skip
        if not used:
            continue
        if cluster.colocate:
            raise ValueError(
                f"{flag} lets the engines generate while the trainer trains, but --colocate "
                "makes them share devices, taking turns; drop one of the two"
            )
        if correction is None:
            raise ValueError(
                f"{flag} trains on samples from older weights than the trainer's: set "
                "--off-policy-correction (e.g. tis) to correct for it"
            )
    if rollout.partial_rollout and not (
        rollout.dynamic_sampling_filter_path or training.fully_async
    ):
        raise ValueError(
            "--partial-rollout resumes groups left over after a filtered rollout, or, with "
            "--fully-async, requests a weight update interrupted; with neither "
            "--dynamic-sampling-filter-path nor --fully-async there are none: drop the flag"
        )
    if rollout.mask_offpolicy_in_partial_rollout and not (training.fully_async and rollout.partial_rollout):  # fmt: skip
        raise ValueError(
            "--mask-offpolicy-in-partial-rollout masks tokens that a --fully-async "
            "--partial-rollout run made with older weights; add both flags or drop this one"
        )
    if not training.fully_async:
        for flag, value, default in (
            ("--max-weight-staleness", training.max_weight_staleness, 1),
            ("--async-unused-samples-handler", training.async_unused_samples_handler, "drop"),
            ("--fully-async-buffer-groups", training.fully_async_buffer_groups, None),
        ):
            if value != default:
                raise ValueError(f"{flag} ({value}) is only read with --fully-async; add it or "
                                 "drop the flag")  # fmt: skip
        return
    _check_fully_async_rollout(config)


def _check_fully_async_rollout(config: MilesConfig) -> None:
    training, rollout = config.training, config.rollout
    if training.fully_async_buffer_groups is None:
        # While a step trains on version v, groups generated now are trained at v + 1 at the
        # earliest: the next `staleness` batches are all the bound lets the trainer take.
        staleness = max(1, training.max_weight_staleness)
        training.fully_async_buffer_groups = staleness * rollout.rollout_batch_size
    if training.fully_async_buffer_groups < rollout.rollout_batch_size:
        raise ValueError(
            f"--fully-async-buffer-groups ({training.fully_async_buffer_groups}) must hold a "
            f"train step's --rollout-batch-size ({rollout.rollout_batch_size}) groups; raise it"
        )
    # Fully-async generation runs one group at a time, the way the rollout function makes each
    # of its samples: the built-in rollout, or one that says how (`sample_generator`).
    from miles.backends.training_utils.import_path import load_function
    from miles.rollout.rollout_config import DEFAULT_ROLLOUT_FUNCTION, ROLLOUT_FUNCTION_FLAG

    default = rollout.rollout_function_path == DEFAULT_ROLLOUT_FUNCTION
    if not default:
        function = load_function(rollout.rollout_function_path, ROLLOUT_FUNCTION_FLAG)
        if getattr(function, "sample_generator", None) is None:
            raise ValueError(
                f"--fully-async generates group by group, but --rollout-function-path "
                f"{rollout.rollout_function_path} makes whole rollouts and does not say how it "
                "makes one sample (a `sample_generator` attribute, see "
                "miles.rollout.generate.sample_generator); use the built-in rollout, the tool "
                "or agent rollout, or add the attribute"
            )
    if rollout.partial_rollout and not (default and rollout.custom_generate_function_path is None):
        raise ValueError(
            "--fully-async --partial-rollout continues an interrupted request from its tokens, "
            "which only the built-in single-turn generation can; drop --partial-rollout for "
            "multi-turn or custom generation (their requests then finish on the old weights)"
        )


def _check_routing_replay(config: MilesConfig) -> None:
    """R3 and R2 replay a MoE model's routing; R3 asks the engines for it on every request."""
    training, rollout = config.training, config.rollout
    flag = (
        "--use-rollout-routing-replay" if training.use_rollout_routing_replay
        else "--use-routing-replay" if training.use_routing_replay else None
    )  # fmt: skip
    if flag is None:
        return
    from miles.utils.hf_config import hf_config_value

    checkpoint = config.checkpoint.hf_checkpoint
    experts = hf_config_value(checkpoint, "num_experts") or hf_config_value(
        checkpoint, "num_local_experts"
    )
    if Path(checkpoint, "config.json").is_file() and not experts:
        raise ValueError(
            f"{flag} replays a MoE model's routing, but {checkpoint} has no experts "
            "(num_experts in its config.json); drop the flag for a dense model"
        )
    if config.cluster.train_backend != "fsdp":
        raise ValueError(f"{flag} is implemented by the FSDP backend; use --train-backend fsdp")
    if training.use_rollout_routing_replay:
        from miles.rollout.rollout_config import DEFAULT_ROLLOUT_FUNCTION

        if rollout.rollout_function_path != DEFAULT_ROLLOUT_FUNCTION or (
            rollout.custom_generate_function_path is not None
        ):
            raise ValueError(
                "--use-rollout-routing-replay keeps each sample's engine routing from the "
                "built-in single-turn generation; multi-turn and custom generation do not ask "
                "for it yet: use --use-routing-replay (R2) with them"
            )
        rollout.return_routed_experts = True


def _check_across_groups(config: MilesConfig) -> None:
    """Every combination of settings that cannot work, or that would silently do nothing."""
    cluster, training = config.cluster, config.training
    if cluster.rollout_num_gpus is None:
        cluster.rollout_num_gpus = (
            cluster.actor_world_size if cluster.colocate else cluster.rollout_num_gpus_per_engine
        )
    plan_for_run(cluster, config.distillation, use_gpus=False)
    _check_async_modes(config)
    _check_reference_model(config)
    _check_distillation(config)
    _check_routing_replay(config)
    if config.engine.use_fault_tolerance and cluster.colocate:
        raise ValueError(
            "--use-fault-tolerance restarts a lost engine at once, but with --colocate it "
            "shares its devices with the trainer, which may hold them then; drop one of the two "
            "flags (fault tolerance is on by default for several separate engines)"
        )
    if config.data.n_samples_per_prompt != config.rollout.n_samples_per_prompt:
        raise AssertionError("n_samples_per_prompt is one option shared by data and rollout")
    if config.reward.rm_type in BUILTIN_RM_TYPES and config.data.label_key is None:
        raise ValueError(
            f"--rm-type {config.reward.rm_type} compares answers with the label, but "
            "--label-key is none; name the dataset column holding the answers"
        )
    if config.checkpoint.load is None and config.checkpoint.save:
        # Resuming from --save is what a restarted run wants; a fresh --save dir has no
        # checkpoint and the run starts at rollout 0.
        config.checkpoint.load = config.checkpoint.save
    gbs = training.global_batch_size
    assert gbs is not None, "derived by _derive_batch_identity"
    world = cluster.actor_world_size
    model_parallel = config.model_parallel_size
    if world % model_parallel:
        raise ValueError(
            f"the {world} train ranks (--actor-num-nodes x --actor-num-gpus-per-node) are not a "
            f"multiple of the {model_parallel} ranks one model replica takes (tensor x pipeline x "
            "context parallel sizes); change either"
        )
    dp = config.data_parallel_size
    if gbs % dp:
        split = f", {model_parallel} ranks per replica" if model_parallel > 1 else ""
        raise ValueError(
            f"--global-batch-size ({gbs}) must be divisible by the data-parallel size "
            f"({dp} = --actor-num-nodes x --actor-num-gpus-per-node{split}); use a multiple "
            f"of {dp}"
        )


def _check_reference_model(config: MilesConfig) -> None:
    """--ref-load and --ref-update-interval configure a reference model only a KL reads."""
    from miles.backends.training_utils.algorithms import Algorithm

    checkpoint = config.checkpoint
    if Algorithm.from_config(config.algorithm).needs_reference:
        if checkpoint.ref_load is not None:
            checkpoint.ref_load = hf_checkpoint_dir("--ref-load", checkpoint.ref_load)
        return
    for flag, value in (("--ref-load", checkpoint.ref_load),
                        ("--ref-update-interval", checkpoint.ref_update_interval)):  # fmt: skip
        if value is not None:
            raise ValueError(
                f"{flag} ({value}) sets up the reference model, which only --kl-coef or "
                "--use-kl-loss reads; add one of them or drop the flag"
            )


def _check_distillation(config: MilesConfig) -> None:
    """--use-opd with the rest: the loss must train on the student's samples, and the teacher
    must read the student's token ids."""
    from miles.backends.training_utils.algorithms import Algorithm
    from miles.utils.hf_config import hf_config_value

    distillation = config.distillation
    if not distillation.use_opd:
        return
    algorithm = Algorithm.from_config(config.algorithm)
    if not algorithm.loss.on_policy:
        raise ValueError(
            f"--use-opd distills on the student's own samples, but --loss-type "
            f"{config.algorithm.loss_type} trains on given data; use an RL loss (policy_loss)"
        )
    if distillation.kl_in_advantages and "advantages" not in algorithm.loss.inputs:
        raise ValueError(
            f"--opd-kl-mode advantages subtracts the teacher KL from the advantages, which "
            f"--loss-type {config.algorithm.loss_type} does not read; use --opd-kl-mode loss"
        )
    teacher = distillation.opd_teacher_checkpoint
    student_vocab = hf_config_value(config.checkpoint.hf_checkpoint, "vocab_size")
    teacher_vocab = hf_config_value(teacher, "vocab_size")
    if student_vocab and teacher_vocab and student_vocab != teacher_vocab:
        raise ValueError(
            f"--opd-teacher-checkpoint {teacher} has a vocabulary of {teacher_vocab} tokens, the "
            f"student (--hf-checkpoint) {student_vocab}: the teacher scores the student's token "
            "ids, so both must share one tokenizer; pick a teacher of the student's family"
        )
    if config.training.debug_train_only or config.training.debug_rollout_only:
        raise ValueError(
            "--use-opd scores each rollout with teacher engines and trains on the scores; "
            "--debug-train-only and --debug-rollout-only run only one half: drop one of them"
        )
