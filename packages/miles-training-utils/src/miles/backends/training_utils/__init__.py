"""miles-training-utils: the algorithm core and the one RL train step every miles backend runs.

A backend implements `TrainEngine` (forward log-probs, forward/backward with a loss callback,
optimizer step, weights, save/load, sleep/wake); `PolicyTrainer` does the rest::

    from miles.backends.training_utils import LossConfig, PolicyTrainer

    trainer = PolicyTrainer(engine, LossConfig(advantage_estimator="grpo"),
                            global_batch_size=64, micro_batch_size=1, max_tokens_per_gpu=None)
    step_metrics = trainer.train(shard)  # this rank's RolloutBatch of the rollout

Losses and advantage estimators are registered once, in `algorithms.registry` (`LOSSES`,
`ESTIMATORS`).

Sub-packages, each importing only those listed before it:
- `infra`: `device` (with `vendor_libs`), `parallel`, `metrics` (cross-rank reductions),
  `import_path`, `checkpoint_paths`;
- `batching`: `sample`, `rollout_data`, `balance`, `micro_batch`, `packing`, `train_batches`;
- `algorithms`: `registry`, `loss_config`, `formulas` (the math), `advantages`, `loss`,
  `algorithm`, and `distillation` and `teacher_kl` (on-policy distillation);
- `step`: `train_engine` (the contract), `trainer`, `logprobs`, `routing_replay`.

The names below resolve on first use: importing a light submodule (`infra.import_path`,
`batching.sample`, `algorithms.loss_config`, `algorithms.distillation`, `algorithms.registry`,
`algorithms.algorithm`) must not import torch, which costs seconds in every process.
"""

import importlib
from typing import Any

_EXPORTS = {
    "algorithms.registry": ("ESTIMATORS", "LOSSES", "EstimatorSpec", "LossSpec"),
    "algorithms.algorithm": ("Algorithm", "compute_advantages_and_returns", "shape_rewards"),
    "algorithms.distillation": ("DistillationConfig",),
    "algorithms.loss": ("LossNormalizer", "policy_loss", "sft_loss"),
    "algorithms.loss_config": ("LossConfig",),
    "batching.sample": ("Sample", "SampleStatus"),
    "step.logprobs": ("get_log_probs_and_entropy",),
    "step.train_engine": ("LoadedCheckpoint", "MicroBatchLoss", "OptimizerStepResult", "TrainEngine"),
    "step.trainer": ("PolicyTrainer",),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_MODULE_OF[name]}")
    return getattr(module, name)
