"""miles-training-utils: the algorithm core and the one RL train step every miles backend runs.

A backend implements `TrainEngine` (forward log-probs, forward/backward with a loss callback,
optimizer step, weights, save/load, sleep/wake); `PolicyTrainer` does the rest::

    from miles.backends.training_utils import LossConfig, PolicyTrainer

    trainer = PolicyTrainer(engine, LossConfig(advantage_estimator="grpo"),
                            global_batch_size=64, micro_batch_size=1, max_tokens_per_gpu=None)
    step_metrics = trainer.train(shard)  # this rank's RolloutBatch of the rollout

Losses and advantage estimators are registered once, in `algorithms` (`LOSSES`, `ESTIMATORS`).

Modules: `trainer`, `train_engine`, `algorithms`, `loss`, `loss_config`, `advantages`,
`ppo_utils` (formulas), `logprobs`, `sample`, `rollout_data`, `balance`, `micro_batch`,
`packing`, `data`, `parallel`, `log_utils`, `import_path`, `ci_utils`, `device`.
"""

from miles.backends.training_utils.algorithms import (
    ESTIMATORS,
    LOSSES,
    Algorithm,
    EstimatorSpec,
    LossSpec,
    compute_advantages_and_returns,
    shape_rewards,
)
from miles.backends.training_utils.logprobs import get_log_probs_and_entropy
from miles.backends.training_utils.loss import LossNormalizer, policy_loss, sft_loss
from miles.backends.training_utils.loss_config import LossConfig
from miles.backends.training_utils.sample import Sample, SampleStatus
from miles.backends.training_utils.train_engine import (
    LoadedCheckpoint,
    MicroBatchLoss,
    OptimizerStepResult,
    TrainEngine,
)
from miles.backends.training_utils.trainer import PolicyTrainer

__all__ = [
    "ESTIMATORS",
    "LOSSES",
    "Algorithm",
    "EstimatorSpec",
    "LoadedCheckpoint",
    "LossConfig",
    "LossNormalizer",
    "LossSpec",
    "MicroBatchLoss",
    "OptimizerStepResult",
    "PolicyTrainer",
    "Sample",
    "SampleStatus",
    "TrainEngine",
    "compute_advantages_and_returns",
    "get_log_probs_and_entropy",
    "policy_loss",
    "sft_loss",
    "shape_rewards",
]
