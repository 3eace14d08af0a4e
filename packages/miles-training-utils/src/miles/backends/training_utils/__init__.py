"""miles-training-utils: the algorithm core and the one RL train step every miles backend runs.

A backend implements `TrainEngine` (forward log-probs, forward/backward with a loss callback,
optimizer step, weights, save/load, sleep/wake); `PolicyTrainer` does the rest::

    from miles.backends.training_utils import LossConfig, PolicyTrainer

    trainer = PolicyTrainer(engine, LossConfig(advantage_estimator="grpo"),
                            global_batch_size=64, micro_batch_size=1, max_tokens_per_gpu=None)
    step_metrics = trainer.train(shard)  # this rank's RolloutBatch of the rollout

Losses and advantage estimators are registered once, in `algorithms` (`LOSSES`, `ESTIMATORS`).

Modules: `trainer`, `train_engine`, `algorithms`, `loss`, `loss_config`, `advantages`,
`ppo_utils` (formulas), `distillation` and `teacher_kl` (on-policy distillation), `logprobs`, `sample`, `rollout_data`, `balance`, `micro_batch`,
`packing`, `data`, `parallel`, `log_utils`, `import_path`, `device`.

The names below resolve on first use: importing a light submodule (`import_path`, `sample`,
`loss_config`, `distillation`, `algorithms`) must not import torch, which costs seconds in every process.
"""

import importlib
from typing import Any

_EXPORTS = {
    "algorithms": (
        "ESTIMATORS", "LOSSES", "Algorithm", "EstimatorSpec", "LossSpec",
        "compute_advantages_and_returns", "shape_rewards",
    ),
    "distillation": ("DistillationConfig",),
    "logprobs": ("get_log_probs_and_entropy",),
    "loss": ("LossNormalizer", "policy_loss", "sft_loss"),
    "loss_config": ("LossConfig",),
    "sample": ("Sample", "SampleStatus"),
    "train_engine": ("LoadedCheckpoint", "MicroBatchLoss", "OptimizerStepResult", "TrainEngine"),
    "trainer": ("PolicyTrainer",),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_MODULE_OF[name]}")
    return getattr(module, name)
