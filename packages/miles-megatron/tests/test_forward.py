"""The actor's micro-batch padding, its refusal of a machine without GPUs, and the flags
`miles train --train-backend megatron` exposes.

The micro-batch path through Megatron's schedules (log-probs of right-padded samples equal the HF
model's, training steps) runs inside the whole actor in test_actor.py, at every parallel layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.backends.megatron_utils.arguments import MegatronArgs
from miles.backends.megatron_utils.forward import pad_micro_batch
from miles.backends.training_utils.algorithms.loss_config import LossConfig

SAMPLES = [list(range(3, 14)), list(range(40, 47))]  # two documents of different lengths
RESPONSE_LENGTHS = [4, 3]


def micro_batch() -> dict:
    return {
        "tokens": SAMPLES,
        "response_lengths": RESPONSE_LENGTHS,
        "total_lengths": [len(t) for t in SAMPLES],
        "loss_mask": [[1] * r for r in RESPONSE_LENGTHS],
        "advantages": [[0.5] * RESPONSE_LENGTHS[0], [-1.0] * RESPONSE_LENGTHS[1]],
    }


def test_pad_micro_batch_points_each_response_token_at_its_predicting_position():
    input_ids, position_ids, positions, targets = pad_micro_batch(micro_batch())
    assert input_ids.shape == (2, 11) and position_ids[1].tolist() == list(range(11))
    assert input_ids[1, 7:].eq(0).all()  # right padding after the shorter document
    assert positions[0].tolist() == [6, 7, 8, 9] and targets[0].tolist() == SAMPLES[0][7:]
    assert positions[1].tolist() == [3, 4, 5] and targets[1].tolist() == SAMPLES[1][4:]


def test_context_parallel_padding_rounds_the_width_up_to_twice_the_ranks():
    input_ids, position_ids, positions, _ = pad_micro_batch(micro_batch(), multiple_of=4)
    assert input_ids.shape == (2, 12) and position_ids.shape == (2, 12)
    assert input_ids[0, 11] == 0 and positions[0].tolist() == [6, 7, 8, 9]


def test_the_actor_refuses_a_machine_without_gpus(tmp_path):
    from miles.backends.megatron_utils.actor import MegatronTrainRayActor
    from miles.train_backend import TrainRunSpec

    actor = MegatronTrainRayActor(0, 1, "127.0.0.1", 29500)
    spec = TrainRunSpec(
        hf_checkpoint=str(tmp_path), rollout_temperature=1.0, global_batch_size=1,
        num_rollout=1, num_steps_per_rollout=1,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"needs NVIDIA or AMD GPUs.*--train-backend fsdp"):
        actor.init(spec, LossConfig(), MegatronArgs())


def test_miles_train_takes_the_megatron_flags():
    from miles.config import load_config

    config = load_config([
        "--hf-checkpoint", "c", "--prompt-data", "d.jsonl", "--rollout-batch-size", "4",
        "--train-backend", "megatron", "--tensor-model-parallel-size", "2",
        "--actor-num-gpus-per-node", "2",
    ])  # fmt: skip
    assert isinstance(config.backend, MegatronArgs)
    assert config.backend.tensor_model_parallel_size == 2


def test_miles_train_takes_ppo_and_hands_the_backend_a_critic_saved_beside_the_policy():
    from miles.config import load_config
    from miles.train_backend import TrainRunSpec

    config = load_config([
        "--hf-checkpoint", "c", "--prompt-data", "d.jsonl", "--rollout-batch-size", "4",
        "--train-backend", "megatron", "--advantage-estimator", "ppo", "--critic-lr", "1e-5",
        "--save", "s",
    ])  # fmt: skip
    critic = TrainRunSpec.from_config(config, num_rollout=1).critic
    assert critic is not None and critic.critic_lr == 1e-5
    assert critic.critic_save == str(Path(config.checkpoint.save) / "critic")


def test_the_rollout_is_split_per_model_replica_not_per_rank():
    from miles.config import load_config

    flags = ["--hf-checkpoint", "c", "--prompt-data", "d.jsonl", "--rollout-batch-size", "2",
             "--train-backend", "megatron", "--tensor-model-parallel-size", "2"]  # fmt: skip
    # 6 samples per step: divisible by the 2 replicas of the 4 ranks, not by the 4 ranks.
    config = load_config([*flags, "--n-samples-per-prompt", "3", "--actor-num-gpus-per-node", "4"])
    assert (config.model_parallel_size, config.data_parallel_size) == (2, 2)
    with pytest.raises(ValueError, match=r"3 train ranks .* not a multiple of the 2 ranks"):
        load_config([*flags, "--actor-num-gpus-per-node", "3"])
