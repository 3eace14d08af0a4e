"""miles-training-utils: the algorithm core every miles training backend trains through.

Example, one GRPO micro-batch step from logits::

    from miles.backends.training_utils import LossConfig, LossNormalizer, loss_function
    from miles.backends.training_utils import get_log_probs_and_entropy

    config = LossConfig(advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=0.28)
    log_probs, entropy = get_log_probs_and_entropy(logits, targets, temperature=1.0)  # (T,)
    batch = {"log_probs": log_probs, "entropy": entropy, "old_log_probs": old, "advantages": adv,
             "loss_mask": mask, "response_lengths": lengths}
    loss, metrics = loss_function(batch, config, LossNormalizer(num_samples=64, num_tokens=n))

Modules: `ppo_utils` (formulas), `advantages`, `loss_config`, `loss`, `logprobs`, `sample`,
`rollout_data`, `balance`, `micro_batch`, `packing`, `data`, `parallel`, `log_utils`,
`ci_utils`, `device`.
"""

from miles.backends.training_utils.advantages import compute_advantages_and_returns, shape_rewards
from miles.backends.training_utils.data import (
    DataIterator,
    get_batch,
    get_data_iterator,
    get_rollout_data,
)
from miles.backends.training_utils.device import DeviceInfo, get_device_info
from miles.backends.training_utils.log_utils import (
    aggregate_forward_results,
    aggregate_train_losses,
    log_rollout_data,
    log_train_step,
)
from miles.backends.training_utils.logprobs import get_log_probs_and_entropy
from miles.backends.training_utils.loss import LossNormalizer, loss_function, value_loss_function
from miles.backends.training_utils.loss_config import LossConfig
from miles.backends.training_utils.parallel import (
    GroupInfo,
    ParallelState,
    get_parallel_state,
    set_parallel_state,
)
from miles.backends.training_utils.sample import Sample, SampleStatus

__all__ = [
    "DataIterator",
    "DeviceInfo",
    "GroupInfo",
    "LossConfig",
    "LossNormalizer",
    "ParallelState",
    "Sample",
    "SampleStatus",
    "aggregate_forward_results",
    "aggregate_train_losses",
    "compute_advantages_and_returns",
    "get_batch",
    "get_data_iterator",
    "get_device_info",
    "get_log_probs_and_entropy",
    "get_parallel_state",
    "get_rollout_data",
    "log_rollout_data",
    "log_train_step",
    "loss_function",
    "set_parallel_state",
    "shape_rewards",
    "value_loss_function",
]
