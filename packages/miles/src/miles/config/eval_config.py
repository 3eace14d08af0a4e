"""The eval group (`EvalConfig`) and one held-out dataset's settings (`EvalDatasetConfig`).

A run names its held-out datasets with `--eval-prompt-data NAME PATH ...` (every dataset shares
the `--eval-*` sampling and the run's reward) or with `--eval-config FILE` (each dataset with its own
sampling, reward, pass@k and interval). Both end as the same list of `EvalDatasetConfig`s, built
when the run's configuration is (`miles.config.eval_datasets`), which the rollout manager evaluates.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from miles.rollout.data_source import DataSourceConfig
from miles.rollout.rewards.config import RewardConfig
from miles.rollout.rollout_config import RolloutConfig

# Evaluation samples with the rollout settings' default seed, not --rollout-seed: that is how held-out
# samples have always been drawn, and a run's evaluations stay comparable across seeds.
EVAL_ROLLOUT_SEED = RolloutConfig.__dataclass_fields__["rollout_seed"].default


@dataclass(frozen=True, kw_only=True)
class EvalDatasetConfig:
    """One held-out dataset, every setting resolved (its own, else the run's); metrics are logged
    as `eval/<name>/...`."""

    name: str
    """The dataset's name in its metrics."""
    data: DataSourceConfig
    """Where its prompts are and how they are read: the run's data settings with this dataset's
    file and keys, served in file order."""
    n_samples_per_eval_prompt: int
    """Answers sampled per prompt."""
    temperature: float
    top_p: float
    top_k: int
    """-1 disables it."""
    max_response_len: int
    """Response token budget of a sample."""
    reward: RewardConfig
    """How its samples are scored: the run's reward settings with this dataset's overrides."""
    pass_at_k: tuple[int, ...]
    """The k of each `eval/<name>/pass@k` (each between 1 and n_samples_per_eval_prompt)."""
    eval_interval: int | None
    """Evaluated every this many rollouts (and before the first and after the last); None: only
    before the first and after the last."""

    @property
    def path(self) -> str:
        return self.data.prompt_data

    def due_after(self, rollout_id: int, num_rollout: int) -> bool:
        """Whether this dataset is evaluated after rollout `rollout_id` of `num_rollout`."""
        done = rollout_id + 1
        return done == num_rollout or bool(self.eval_interval and done % self.eval_interval == 0)

    def rollout_config(self, run: RolloutConfig, num_prompts: int) -> RolloutConfig:
        """The run's rollout settings for one evaluation of this dataset: every prompt once, this
        dataset's sampling, no filter, no partial rollout, no routing kept; the multi-turn
        settings (tools, agent, turns) stay the run's."""
        return dataclasses.replace(
            run,
            rollout_batch_size=num_prompts,
            n_samples_per_prompt=self.n_samples_per_eval_prompt,
            over_sampling_batch_size=None,
            rollout_max_response_len=self.max_response_len,
            rollout_temperature=self.temperature,
            rollout_top_p=self.top_p,
            rollout_top_k=self.top_k,
            dynamic_sampling_filter_path=None,
            partial_rollout=False,
            return_routed_experts=False,
            mask_offpolicy_in_partial_rollout=False,
            rollout_seed=EVAL_ROLLOUT_SEED,
        )


def _at_least(value: int | None, minimum: int, flag: str) -> None:
    if value is not None and value < minimum:
        raise ValueError(f"{flag} must be >= {minimum}, got {value}")


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out evaluation during training."""

    eval_prompt_data: list[str] | None = None
    """Evaluation datasets as name/path pairs: `--eval-prompt-data gsm8k data/gsm8k_test.jsonl`."""
    eval_config: str | None = None
    """A YAML or JSON file of evaluation datasets, each with its own sampling, reward, pass@k and
    interval (docs/guides/recipes.md); replaces --eval-prompt-data. Settings a dataset leaves
    out are the run's (--n-samples-per-eval-prompt, --eval-temperature, --rm-type, ...)."""
    eval_interval: int | None = None
    """Evaluate every this many rollouts (and before the first and after the last)."""
    n_samples_per_eval_prompt: int = 1
    """Answers sampled per evaluation prompt (pass@k uses them)."""
    eval_max_response_len: int | None = None
    """Response length limit at evaluation; default: --rollout-max-response-len."""
    eval_temperature: float | None = None
    """Sampling temperature at evaluation; default: --rollout-temperature."""
    eval_datasets: list[EvalDatasetConfig] = field(default_factory=list, init=False)
    """Every dataset of --eval-prompt-data or --eval-config, resolved when the run's configuration
    is built (`miles.config.eval_datasets`)."""

    def __post_init__(self) -> None:
        _at_least(self.eval_interval, 1, "--eval-interval")
        _at_least(self.n_samples_per_eval_prompt, 1, "--n-samples-per-eval-prompt")
        _at_least(self.eval_max_response_len, 1, "--eval-max-response-len")
        if self.eval_prompt_data is not None and len(self.eval_prompt_data) % 2:
            raise ValueError(
                f"--eval-prompt-data takes name/path pairs, got {self.eval_prompt_data}; e.g. "
                "--eval-prompt-data gsm8k data/gsm8k_test.jsonl"
            )
        if self.eval_config is not None and self.eval_prompt_data:
            raise ValueError(
                f"--eval-config ({self.eval_config}) replaces --eval-prompt-data "
                f"({' '.join(self.eval_prompt_data)}); drop --eval-prompt-data and list those "
                "datasets in the file (name: ..., path: ...)"
            )
        if self.eval_interval is not None and not (self.eval_prompt_data or self.eval_config):
            raise ValueError(
                f"--eval-interval {self.eval_interval} has nothing to evaluate: set "
                "--eval-prompt-data NAME PATH or --eval-config FILE"
            )
