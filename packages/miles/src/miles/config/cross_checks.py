"""Checks across setting groups: combinations that cannot work, or that would silently do nothing.

Each check reads the groups it is given and raises a ValueError naming the flags and the fix; none
writes to a group (derived values are `derivation`'s). A group's own fields are checked where it
is built. `MilesConfig` runs these in a fixed order, which decides the error that a configuration
with several mistakes reports.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from miles.backends.training_utils.infra.checkpoint_paths import hf_checkpoint_dir
from miles.config.placement_plan import plan_for_run
from miles.rollout.rewards.config import BUILTIN_RM_TYPES

if TYPE_CHECKING:
    from miles.backends.training_utils.algorithms.critic_config import CriticConfig
    from miles.backends.training_utils.algorithms.distillation import DistillationConfig
    from miles.backends.training_utils.algorithms.loss_config import LossConfig
    from miles.config.groups import CheckpointConfig, ClusterConfig, EngineConfig, TrainingConfig
    from miles.config.trainer_args import TrainerArgs
    from miles.rollout.contract import Rollout
    from miles.rollout.data_source import DataSourceConfig
    from miles.rollout.rewards import RewardConfig
    from miles.rollout.rollout_config import RolloutConfig
    from miles.utils.observability.config import ObservabilityConfig


def check_placement(
    cluster: ClusterConfig, distillation: DistillationConfig, critic: CriticConfig
) -> None:
    """The placement flags describe a layout of train ranks, engines, teachers and a critic."""
    plan_for_run(cluster, distillation, use_gpus=False, critic=critic)


def check_async_modes(
    cluster: ClusterConfig,
    training: TrainingConfig,
    rollout: RolloutConfig,
    algorithm: LossConfig,
    made: Rollout,
) -> None:
    """--async-train, --fully-async and --update-weights-interval: each trains on samples of
    older weights than the trainer's."""
    correction = algorithm.off_policy_correction
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
    _check_fully_async(training, rollout, made)


def _check_fully_async(training: TrainingConfig, rollout: RolloutConfig, made: Rollout) -> None:
    buffer_groups = training.fully_async_buffer_groups
    assert buffer_groups is not None, "derived by derivation.fully_async_buffer_groups"
    if buffer_groups < rollout.rollout_batch_size:
        raise ValueError(
            f"--fully-async-buffer-groups ({buffer_groups}) must hold a "
            f"train step's --rollout-batch-size ({rollout.rollout_batch_size}) groups; raise it"
        )
    check_rollout_function(made, rollout, for_flag="--fully-async")


def load_run_rollout(rollout: RolloutConfig) -> Rollout:
    """The rollout --rollout-function-path names, loaded as the rollout manager will load it:
    once per configuration, for the checks below."""
    # Deferred: the rollout modules import the engine client, which `miles train --help` never
    # needs.
    from miles.rollout.loader import load_rollout

    return load_rollout(rollout)


def check_rollout(made: Rollout, rollout: RolloutConfig, data: DataSourceConfig) -> None:
    """The run's rollout accepts these settings (`Rollout.check`: the multi-turn flags with the
    single-turn rollout, a tool rollout without --tool-paths or --apply-chat-template, ...)."""
    made.check(rollout, data)


def check_rollout_function(
    made: Rollout,
    rollout: RolloutConfig,
    *,
    for_flag: Literal["--fully-async", "--use-rollout-routing-replay"],
) -> None:
    """What `for_flag` needs of the run's rollout, read from its capabilities
    (`miles.rollout.contract.Rollout`). Each feature calls it where its other checks run, so a
    configuration with several mistakes reports its errors in a fixed order."""
    if for_flag == "--use-rollout-routing-replay":
        if not made.returns_routed_experts:
            raise ValueError(
                "--use-rollout-routing-replay keeps each sample's engine routing from the "
                "built-in single-turn generation; multi-turn and custom generation do not ask "
                "for it yet: use --use-routing-replay (R2) with them"
            )
        return
    # Fully-async generation runs one group at a time: the rollout's `generate_group`.
    if not made.makes_groups:
        raise ValueError(
            f"--fully-async generates group by group, but --rollout-function-path "
            f"{rollout.rollout_function_path} makes whole rollouts only (a function of the "
            "earlier signature); use the built-in rollout, the tool or agent rollout, or write "
            "it as a miles.rollout.contract.Rollout (docs/guides/adding-a-rollout-function.md)"
        )
    if rollout.partial_rollout and not made.continues_partial_requests:
        raise ValueError(
            "--fully-async --partial-rollout continues an interrupted request from its tokens, "
            "which only the built-in single-turn generation can; drop --partial-rollout for "
            "multi-turn or custom generation (their requests then finish on the old weights)"
        )


def check_reference_model(algorithm: LossConfig, checkpoint: CheckpointConfig) -> None:
    """--ref-load and --ref-update-interval configure a reference model only a KL reads."""
    from miles.backends.training_utils.algorithms.algorithm import Algorithm

    if Algorithm.from_config(algorithm).needs_reference:
        if checkpoint.ref_load is not None:
            # Refuses a missing checkpoint; the path is made absolute with the others.
            hf_checkpoint_dir("--ref-load", checkpoint.ref_load)
        return
    for flag, value in (("--ref-load", checkpoint.ref_load),
                        ("--ref-update-interval", checkpoint.ref_update_interval)):  # fmt: skip
        if value is not None:
            raise ValueError(
                f"{flag} ({value}) sets up the reference model, which only --kl-coef or "
                "--use-kl-loss reads; add one of them or drop the flag"
            )


def check_lora(backend: TrainerArgs | None, checkpoint: CheckpointConfig) -> None:
    """LoRA shares the frozen base with the reference model (the policy with its adapters off),
    so the reference cannot move to the policy."""
    if backend is None or not backend.uses_lora:
        return
    if checkpoint.ref_update_interval is not None:
        raise ValueError(
            f"--ref-update-interval ({checkpoint.ref_update_interval}) copies the policy into the "
            f"reference model, but with --lora-rank {backend.lora_rank} the reference is the "
            "frozen base (the policy with its adapters off); drop --ref-update-interval"
        )


def check_critic(
    critic: CriticConfig,
    algorithm: LossConfig,
    backend: TrainerArgs | None,
    cluster: ClusterConfig,
) -> None:
    """A critic is trained exactly when the estimator reads values (ppo), by a backend that
    trains one, from a checkpoint that reads the policy's token ids; on ranks of its own, as
    many as the policy's (it takes their data-parallel shards)."""
    from miles.backends.training_utils.algorithms.algorithm import Algorithm

    estimator = algorithm.advantage_estimator
    if not Algorithm.from_config(algorithm).estimator.needs_critic:
        given = critic.given()
        if given:
            raise ValueError(
                f"{', '.join(given)} configure the critic, but --advantage-estimator {estimator} "
                "reads no values and trains none; use --advantage-estimator ppo or drop them"
            )
        return
    if backend is not None and not backend.trains_critic:
        raise ValueError(
            f"--advantage-estimator {estimator} trains a critic, which the "
            f"{type(backend).__name__} backend does not; use --train-backend fsdp or megatron"
        )
    if critic.critic_hf_checkpoint is not None:
        hf_checkpoint_dir("--critic-hf-checkpoint", critic.critic_hf_checkpoint)
    if critic.on_own_ranks:
        policy = (cluster.actor_num_nodes, cluster.actor_num_gpus_per_node)
        nodes, per_node = critic.ranks(*policy)
        if nodes * per_node != policy[0] * policy[1]:
            raise ValueError(
                f"--critic-num-nodes {nodes} x --critic-num-gpus-per-node {per_node} = "
                f"{nodes * per_node} critic ranks, but the policy has {policy[0] * policy[1]} "
                f"(--actor-num-nodes {policy[0]} x --actor-num-gpus-per-node {policy[1]}); a "
                "critic on ranks of its own trains on the policy's data-parallel shards, so it "
                "needs as many ranks: change one of the two, or drop --critic-num-nodes and "
                "--critic-num-gpus-per-node to run the critic on the policy's ranks"
            )


def check_critic_vocabulary(critic: CriticConfig, hf_checkpoint: str) -> None:
    """The critic reads the policy's token ids: its vocabulary must be the policy's."""
    if critic.critic_hf_checkpoint is None:
        return
    from miles.utils.hf_config import hf_config_value

    ours = hf_config_value(hf_checkpoint, "vocab_size")
    theirs = hf_config_value(critic.critic_hf_checkpoint, "vocab_size")
    if ours != theirs:
        raise ValueError(
            f"--critic-hf-checkpoint {critic.critic_hf_checkpoint} has a vocabulary of {theirs} "
            f"tokens, the policy ({hf_checkpoint}) one of {ours}; the critic reads the policy's "
            "token ids: start it from a checkpoint with the policy's tokenizer"
        )


def check_distillation(
    distillation: DistillationConfig,
    algorithm: LossConfig,
    checkpoint: CheckpointConfig,
    training: TrainingConfig,
) -> None:
    """--use-opd with the rest: the loss must train on the student's samples, and the teacher
    must read the student's token ids."""
    from miles.backends.training_utils.algorithms.algorithm import Algorithm
    from miles.utils.hf_config import hf_config_value

    if not distillation.use_opd:
        return
    chosen = Algorithm.from_config(algorithm)
    if not chosen.loss.on_policy:
        raise ValueError(
            f"--use-opd distills on the student's own samples, but --loss-type "
            f"{algorithm.loss_type} trains on given data; use an RL loss (policy_loss)"
        )
    if distillation.kl_in_advantages and "advantages" not in chosen.loss.inputs:
        raise ValueError(
            f"--opd-kl-mode advantages subtracts the teacher KL from the advantages, which "
            f"--loss-type {algorithm.loss_type} does not read; use --opd-kl-mode loss"
        )
    teacher = distillation.opd_teacher_checkpoint
    student_vocab = hf_config_value(checkpoint.hf_checkpoint, "vocab_size")
    teacher_vocab = hf_config_value(teacher, "vocab_size")
    if student_vocab and teacher_vocab and student_vocab != teacher_vocab:
        raise ValueError(
            f"--opd-teacher-checkpoint {teacher} has a vocabulary of {teacher_vocab} tokens, the "
            f"student (--hf-checkpoint) {student_vocab}: the teacher scores the student's token "
            "ids, so both must share one tokenizer; pick a teacher of the student's family"
        )
    if training.debug_train_only or training.debug_rollout_only:
        raise ValueError(
            "--use-opd scores each rollout with teacher engines and trains on the scores; "
            "--debug-train-only and --debug-rollout-only run only one half: drop one of them"
        )


def check_routing_replay(
    training: TrainingConfig,
    rollout: RolloutConfig,
    checkpoint: CheckpointConfig,
    cluster: ClusterConfig,
    made: Rollout,
) -> None:
    """R3 and R2 replay a MoE model's routing; R3 asks the engines for it on every request."""
    flag = (
        "--use-rollout-routing-replay" if training.use_rollout_routing_replay
        else "--use-routing-replay" if training.use_routing_replay else None
    )  # fmt: skip
    if flag is None:
        return
    from miles.utils.hf_config import hf_config_value

    hf_checkpoint = checkpoint.hf_checkpoint
    experts = hf_config_value(hf_checkpoint, "num_experts") or hf_config_value(
        hf_checkpoint, "num_local_experts"
    )
    if Path(hf_checkpoint, "config.json").is_file() and not experts:
        raise ValueError(
            f"{flag} replays a MoE model's routing, but {hf_checkpoint} has no experts "
            "(num_experts in its config.json); drop the flag for a dense model"
        )
    if cluster.train_backend != "fsdp":
        raise ValueError(f"{flag} is implemented by the FSDP backend; use --train-backend fsdp")
    if training.use_rollout_routing_replay:
        check_rollout_function(made, rollout, for_flag="--use-rollout-routing-replay")


def check_fault_tolerance(engine: EngineConfig, cluster: ClusterConfig) -> None:
    """--use-fault-tolerance cannot restart an engine whose devices the trainer may hold."""
    if engine.use_fault_tolerance and cluster.colocate:
        raise ValueError(
            "--use-fault-tolerance restarts a lost engine at once, but with --colocate it "
            "shares its devices with the trainer, which may hold them then; drop one of the two "
            "flags (fault tolerance is on by default for engines that are not colocated)"
        )


def check_labels(reward: RewardConfig, data: DataSourceConfig) -> None:
    """A built-in reward compares answers with the label column."""
    if reward.rm_type in BUILTIN_RM_TYPES and data.label_key is None:
        raise ValueError(
            f"--rm-type {reward.rm_type} compares answers with the label, but "
            "--label-key is none; name the dataset column holding the answers"
        )


def check_images(data: DataSourceConfig, hf_checkpoint: str) -> None:
    """Data with images (--multimodal-keys) needs a model with a vision tower."""
    from miles.utils.hf_config import hf_config_value

    if data.image_key is None or hf_config_value(hf_checkpoint, "model_type") is None:
        return  # text-only data, or a hub id whose config is read where it is downloaded
    if hf_config_value(hf_checkpoint, "vision_config") is None:
        model_type = hf_config_value(hf_checkpoint, "model_type")
        raise ValueError(
            f"--multimodal-keys {data.multimodal_keys}: the data has images, but --hf-checkpoint "
            f"{hf_checkpoint} ({model_type}) has no vision tower; use a vision-language "
            "checkpoint (e.g. Qwen2.5-VL) or drop --multimodal-keys"
        )


def check_mixture(reward: RewardConfig, data: DataSourceConfig) -> None:
    """Each source of a --prompt-data mixture names a reward the run can score with."""
    from miles.rollout.mixture import source_reward

    for source in data.mixture or []:
        source_reward(source, reward, data.prompt_data)


def check_parallel_sizes(
    cluster: ClusterConfig, training: TrainingConfig, *, model_parallel_size: int
) -> None:
    """The train ranks split into whole model replicas, and each step's batch into equal shards."""
    gbs = training.global_batch_size
    assert gbs is not None, "derived by derivation.batch_identity"
    world = cluster.actor_world_size
    model_parallel = model_parallel_size
    if world % model_parallel:
        raise ValueError(
            f"the {world} train ranks (--actor-num-nodes x --actor-num-gpus-per-node) are not a "
            f"multiple of the {model_parallel} ranks one model replica takes (tensor x pipeline x "
            "context parallel sizes); change either"
        )
    dp = world // model_parallel
    if gbs % dp:
        split = f", {model_parallel} ranks per replica" if model_parallel > 1 else ""
        raise ValueError(
            f"--global-batch-size ({gbs}) must be divisible by the data-parallel size "
            f"({dp} = --actor-num-nodes x --actor-num-gpus-per-node{split}); use a multiple "
            f"of {dp}"
        )


def check_observability(observability: ObservabilityConfig, training: TrainingConfig) -> None:
    """A profiled process the run has, and a profiling window inside the run."""
    targets = observability.profiles
    if not targets:
        return
    without = {"train": ("--debug-rollout-only", training.debug_rollout_only)}
    for target in ("rollout-manager", "engine"):
        without[target] = ("--debug-train-only", training.debug_train_only)
    for target in targets:
        flag, missing = without[target]
        if missing:
            raise ValueError(
                f"--profile-target {target}: a run with {flag} has no such process to profile; "
                f"drop {target} from --profile-target"
            )
    num_rollout = training.num_rollout
    if num_rollout is not None and observability.profile_step_start >= num_rollout:
        raise ValueError(
            f"--profile-step-start {observability.profile_step_start} is past the run's last "
            f"rollout ({num_rollout - 1}, --num-rollout {num_rollout}); profile an earlier rollout"
        )
